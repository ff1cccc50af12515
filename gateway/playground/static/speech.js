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
export class Speaking {
  constructor() {
    this.player = new StreamPlayer();
    this.abort = new AbortController();
  }

  stop() {
    this.abort.abort();
    this.player.stop();
  }
}

// Once the stream has ended: when its last scheduled sample has played, frees the audio
// context (browsers allow only a few at once) and calls `done` (unless it was stopped).
export function afterPlayback(speaking, done) {
  setTimeout(() => {
    if (speaking.abort.signal.aborted) return;
    speaking.player.stop();
    done();
  }, speaking.player.remaining() * 1000);
}

export function setupSpeech() {
  const form = document.getElementById("speech-form");
  const status = document.getElementById("speech-status");
  const model = document.getElementById("speech-model");
  const voice = document.getElementById("speech-voice");
  const stop = form.querySelector("button.stop");
  let speaking = null;

  model.addEventListener("change", () => loadVoices(model, voice));
  document.addEventListener("models-loaded", () => loadVoices(model, voice));
  stop.addEventListener("click", () => {
    speaking?.stop();
    stop.disabled = true;
    status.textContent = "Stopped.";
  });

  form.addEventListener("submit", async (submitted) => {
    submitted.preventDefault();
    speaking?.stop();
    const current = new Speaking();
    speaking = current;
    stop.disabled = false;
    status.textContent = "Speaking…";
    try {
      const response = await api("/v1/audio/speech", { method: "POST",
        signal: current.abort.signal, json: { model: model.value, voice: voice.value,
          input: form.elements.text.value, response_format: "wav", stream: true } });
      const reader = response.body.getReader();
      for (let chunk = await reader.read(); !chunk.done; chunk = await reader.read()) {
        current.player.feed(chunk.value);
      }
      afterPlayback(current, () => {
        status.textContent = "Done.";
        stop.disabled = true;
      });
    } catch (error) {
      if (isAbort(error)) return; // stopped, or replaced by a newer request
      status.textContent = describe(error);
      stop.disabled = true;
    }
  });
}
