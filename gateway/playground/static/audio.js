// Plays streamed 16-bit mono PCM as it arrives: each piece becomes an AudioBuffer scheduled right
// after the previous one on one AudioContext clock, so playback starts with the first piece and
// has no gaps. The stream is a WAV (its header first, then samples: the speech and chat routes)
// or raw PCM at a known rate (the realtime route's audio deltas).

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
  // `rate`: the stream is raw PCM at this rate (else a WAV, whose header says it). `context`:
  // where it plays (else a new one: created in the click handler that starts playback, since
  // browsers allow sound then); stop() closes it either way.
  constructor({ context = new AudioContext(), rate = 0 } = {}) {
    this.context = context;
    this.pending = new Uint8Array(0);
    this.rate = rate;
    this.nextTime = 0;
    this.sources = new Set();
    this.stopped = false;
    this.scheduledSeconds = 0;
  }

  // Feed bytes of the stream as they come.
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
    this.scheduledSeconds += buffer.duration;
    window.stagemeshAudio.scheduledSeconds += buffer.duration;
  }

  // Drops what is scheduled and not yet heard (the listener spoke over it); a later piece
  // plays at once.
  silence() {
    for (const source of this.sources) source.stop();
    this.sources.clear();
    this.nextTime = 0;
  }

  // Seconds of scheduled audio still to play.
  remaining() {
    return Math.max(0, this.nextTime - this.context.currentTime);
  }

  stop() {
    if (this.stopped) return;
    this.stopped = true;
    this.silence();
    this.context.close();
  }
}

export function base64Bytes(text) {
  return Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
}

// The inverse, in slices (String.fromCharCode takes a bounded number of arguments).
export function bytesBase64(bytes) {
  const SLICE = 0x8000;
  let text = "";
  for (let at = 0; at < bytes.length; at += SLICE) {
    text += String.fromCharCode(...bytes.subarray(at, at + SLICE));
  }
  return btoa(text);
}
