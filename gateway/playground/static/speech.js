// The speech tab: streamed speech that plays while the stages still produce it; Stop ends both
// the playback and the request (the gateway sees the client leave and stops talker and codec).

import { api, apiJson, describe, isAbort } from "./api.js";
import { StreamPlayer } from "./audio.js";

async function loadVoices(model, select) {
  if (model.disabled) return; // no speech model served
  try {
    const { voices } = await apiJson(`/v1/audio/voices?model=${encodeURIComponent(model.value)}`);
    select.replaceChildren(...["default", ...voices].map((voice) => new Option(voice)));
  } catch {
    // keep "default": every speech model has it
  }
}

// One playback: stops the player and aborts the fetch together.
class Speaking {
  constructor() {
    this.player = new StreamPlayer();
    this.abort = new AbortController();
  }

  stop() {
    this.abort.abort();
    this.player.stop();
  }
}

// One Stop button and status line over successive playbacks (a new one stops the last).
export class Speaker {
  constructor(stop, status) {
    this.stop = stop;
    this.status = status;
    this.current = null;
    stop.addEventListener("click", () => {
      this.current?.stop();
      this.finish("Stopped.");
    });
  }

  // Runs `request(speaking)`, a fetch that feeds `speaking.player` and aborts on
  // `speaking.abort`, then says "Done." once its last sample has played and frees the audio
  // context (browsers allow only a few). A failure is shown; a stop or a newer request is not.
  async run(request, text) {
    this.current?.stop();
    const speaking = new Speaking();
    this.current = speaking;
    this.stop.disabled = false;
    this.status.textContent = text;
    try {
      await request(speaking);
      setTimeout(() => {
        if (speaking.abort.signal.aborted) return;
        speaking.player.stop();
        this.finish("Done.");
      }, speaking.player.remaining() * 1000);
    } catch (error) {
      if (!isAbort(error)) this.finish(describe(error));
    }
  }

  finish(text) {
    this.status.textContent = text;
    this.stop.disabled = true;
  }
}

export function setupSpeech() {
  const form = document.getElementById("speech-form");
  const model = document.getElementById("speech-model");
  const voice = document.getElementById("speech-voice");
  const speaker = new Speaker(form.querySelector("button.stop"),
    document.getElementById("speech-status"));

  model.addEventListener("change", () => loadVoices(model, voice));
  document.addEventListener("models-loaded", () => loadVoices(model, voice));
  form.addEventListener("submit", (submitted) => {
    submitted.preventDefault();
    speaker.run(async (speaking) => {
      const response = await api("/v1/audio/speech", { method: "POST",
        signal: speaking.abort.signal, json: { model: model.value, voice: voice.value,
          input: form.elements.text.value, response_format: "wav", stream: true } });
      const reader = response.body.getReader();
      for (let chunk = await reader.read(); !chunk.done; chunk = await reader.read()) {
        speaking.player.feed(chunk.value);
      }
    }, "Speaking…");
  });
}
