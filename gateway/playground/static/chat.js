// The chat tab: a streamed conversation, answered in text or out loud (the answer's audio
// plays sentence by sentence while the thinker still writes).

import { api, describe, isAbort, sseEvents } from "./api.js";
import { base64Bytes } from "./audio.js";
import { afterPlayback, Speaking } from "./speech.js";

function entry(log, role, text) {
  const item = document.createElement("li");
  item.className = role;
  const who = document.createElement("strong");
  who.textContent = role === "user" ? "You" : "Model";
  const said = document.createElement("span");
  said.textContent = text;
  item.append(who, said);
  log.append(item);
  return said;
}

export function setupChat() {
  const form = document.getElementById("chat-form");
  const log = document.getElementById("chat-log");
  const status = document.getElementById("chat-status");
  const stop = form.querySelector("button.stop");
  const messages = [];
  let current = null;

  stop.addEventListener("click", () => {
    current?.stop();
    stop.disabled = true;
    status.textContent = "Stopped.";
  });

  form.addEventListener("submit", async (submitted) => {
    submitted.preventDefault();
    current?.stop();
    const spoken = form.elements.spoken.checked;
    const run = new Speaking();
    current = run;
    const text = form.elements.text.value;
    form.elements.text.value = "";
    messages.push({ role: "user", content: text });
    entry(log, "user", text);
    const answer = entry(log, "assistant", "");
    stop.disabled = false;
    status.textContent = "Thinking…";
    const body = { model: form.elements.model.value, messages, stream: true };
    if (spoken) Object.assign(body, { modalities: ["text", "audio"],
      audio: { voice: "default", format: "wav" } });
    try {
      const response = await api("/v1/chat/completions", { method: "POST", json: body,
        signal: run.abort.signal });
      for await (const chunk of sseEvents(response)) {
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices?.[0]?.delta ?? {};
        answer.textContent += delta.content ?? delta.audio?.transcript ?? "";
        if (delta.audio?.data) run.player.feed(base64Bytes(delta.audio.data));
      }
      messages.push({ role: "assistant", content: answer.textContent });
      log.lastChild.dataset.complete = "true";
      status.textContent = spoken ? "Speaking…" : "Done.";
      afterPlayback(run, () => {
        status.textContent = "Done.";
        stop.disabled = true;
      });
    } catch (error) {
      if (isAbort(error)) return; // stopped, or replaced by a newer message
      status.textContent = describe(error);
      stop.disabled = true;
    }
  });
}
