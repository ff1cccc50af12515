// Plays a streamed WAV (its header first, then 16-bit mono PCM as the stages produce it) while it
// arrives: each piece becomes an AudioBuffer scheduled right after the previous one on one
// AudioContext clock, so playback starts with the first chunk and has no gaps.

// Seconds of audio this page has scheduled, for the browser test (and anyone curious).
window.stagemeshAudio = { scheduledSeconds: 0 };

// Scheduling slack before the first piece, so it does not start in the past.
const LEAD_SECONDS = 0.05;

function wavFormat(bytes) {
  // RIFF chunks after "WAVE": "fmt " holds the rate; "data" (size unknown while streamed) the
  // samples. Returns null until the header is complete.
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  let rate = 0;
  for (let at = 12; at + 8 <= bytes.length;) {
    const id = String.fromCharCode(...bytes.subarray(at, at + 4));
    const size = view.getUint32(at + 4, true);
    if (id === "fmt " && at + 16 <= bytes.length) rate = view.getUint32(at + 12, true);
    if (id === "data") return { rate, dataStart: at + 8 };
    at += 8 + size;
  }
  return null;
}

export class StreamPlayer {
  constructor() {
    // Created in the click handler that starts playback: browsers allow sound then.
    this.context = new AudioContext();
    this.pending = new Uint8Array(0);
    this.rate = 0;
    this.nextTime = 0;
    this.sources = new Set();
    this.stopped = false;
  }

  // Feed bytes of the WAV stream as they come.
  feed(chunk) {
    if (this.stopped) return;
    const joined = new Uint8Array(this.pending.length + chunk.length);
    joined.set(this.pending);
    joined.set(chunk, this.pending.length);
    let bytes = joined;
    if (!this.rate) {
      const format = wavFormat(bytes);
      if (!format) {
        this.pending = bytes;
        return;
      }
      this.rate = format.rate;
      bytes = bytes.subarray(format.dataStart);
    }
    const whole = bytes.length - (bytes.length % 2); // an odd byte waits for its pair
    this.pending = bytes.slice(whole);
    if (whole) this.schedule(new DataView(bytes.buffer, bytes.byteOffset, whole));
  }

  schedule(view) {
    const count = view.byteLength / 2;
    const buffer = this.context.createBuffer(1, count, this.rate);
    const samples = buffer.getChannelData(0);
    for (let i = 0; i < count; i++) samples[i] = view.getInt16(2 * i, true) / 32768;
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.context.destination);
    const start = Math.max(this.nextTime, this.context.currentTime + LEAD_SECONDS);
    source.start(start);
    this.nextTime = start + buffer.duration;
    this.sources.add(source);
    source.onended = () => this.sources.delete(source);
    window.stagemeshAudio.scheduledSeconds += buffer.duration;
  }

  // Seconds of scheduled audio still to play.
  remaining() {
    return Math.max(0, this.nextTime - this.context.currentTime);
  }

  stop() {
    if (this.stopped) return;
    this.stopped = true;
    for (const source of this.sources) source.stop();
    this.sources.clear();
    this.context.close();
  }
}

export function base64Bytes(text) {
  return Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
}
