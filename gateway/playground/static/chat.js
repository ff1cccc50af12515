// The chat tab: a streamed conversation, answered in text or out loud (the answer's audio
// plays sentence by sentence while the thinker still writes).

import { api, sseEvents } from "./api.js";
import { base64Bytes } from "./audio.js";
import { Speaker } from "./speech.js";

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
  const speaker = new Speaker(form.querySelector("button.stop"),
    document.getElementById("chat-status"));
  const messages = [];

  form.addEventListener("submit", (submitted) => {
    submitted.preventDefault();
    const spoken = form.elements.spoken.checked;
    const text = form.elements.text.value;
    form.elements.text.value = "";
    messages.push({ role: "user", content: text });
    entry(log, "user", text);
    const answer = entry(log, "assistant", "");
    const body = { model: form.elements.model.value, messages, stream: true };
    if (spoken) Object.assign(body, { modalities: ["text", "audio"],
      audio: { voice: "default", format: "wav" } });
    speaker.run(async (speaking) => {
      const response = await api("/v1/chat/completions", { method: "POST", json: body,
        signal: speaking.abort.signal });
      for await (const chunk of sseEvents(response)) {
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices?.[0]?.delta ?? {};
        answer.textContent += delta.content ?? delta.audio?.transcript ?? "";
        if (delta.audio?.data) speaking.player.feed(base64Bytes(delta.audio.data));
      }
      messages.push({ role: "assistant", content: answer.textContent });
      answer.parentElement.dataset.complete = "true";
      if (spoken) speaker.status.textContent = "Speaking…";
    }, "Thinking…");
  });
}
