// The microphone's audio thread (an AudioWorklet module, loaded by talk.js): resamples channel 0
// from the AudioContext's rate to the realtime route's rate and posts 16-bit PCM in fixed-size
// chunks (an ArrayBuffer each, transferred) to the page, which sends them on.
//
// Resampling averages the input over each output sample's span (a box filter: enough
// anti-aliasing for speech going from 44.1 or 48 kHz down to 24 kHz); a microphone slower than
// the output rate is held sample by sample.

const INT16_MAX = 32767;

class Pcm16Capture extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const { rate, chunk } = options.processorOptions;
    this.span = sampleRate / rate; // input samples per output sample (`sampleRate`: the context's)
    this.chunk = chunk;
    this.out = new Int16Array(chunk);
    this.filled = 0;
    this.sum = 0; // input of the output sample being made, weighted by how much of it is in span
    this.covered = 0; // how much of its span the input has covered so far
  }

  process(inputs) {
    const channel = inputs[0][0];
    if (channel) for (const sample of channel) this.take(sample);
    return true; // keep running while the page holds the node
  }

  take(sample) {
    let left = 1; // what of this input sample is not yet assigned to an output sample
    while (this.covered + left >= this.span) {
      const part = this.span - this.covered;
      this.emit((this.sum + sample * part) / this.span);
      left -= part;
      this.sum = 0;
      this.covered = 0;
    }
    this.sum += sample * left;
    this.covered += left;
  }

  emit(value) {
    this.out[this.filled++] = Math.round(Math.max(-1, Math.min(1, value)) * INT16_MAX);
    if (this.filled < this.chunk) return;
    this.port.postMessage(this.out.buffer, [this.out.buffer]);
    this.out = new Int16Array(this.chunk);
    this.filled = 0;
  }
}

registerProcessor("pcm16-capture", Pcm16Capture);
