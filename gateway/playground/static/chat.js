// The chat tab: a streamed conversation, typed and answered in text or out loud (the answer's
// audio plays sentence by sentence while the thinker still writes), or spoken through the
// microphone (talk.js). Typed and spoken turns are one conversation.

import { api, sseEvents } from "./api.js";
import { base64Bytes } from "./audio.js";
import { Speaker } from "./speech.js";
import { setupTalk } from "./talk.js";

// The conversation: its log on the page and its messages, as the chat route takes them.
class Conversation {
  constructor(log) {
    this.log = log;
    this.messages = [];
  }

  // A new entry in the log; returns the element its text goes in (filled as it streams).
  show(role, text, { spoken = false } = {}) {
    const item = document.createElement("li");
    item.className = role;
    if (spoken) item.dataset.spoken = "true";
    const who = document.createElement("strong");
    who.textContent = `${role === "user" ? "You" : "Model"}${spoken ? " (spoken)" : ""}`;
    const said = document.createElement("span");
    said.textContent = text;
    item.append(who, said);
    this.log.append(item);
    return said;
  }

  remember(role, content) {
    this.messages.push({ role, content });
  }

  add(role, text, options) {
    this.remember(role, text);
    return this.show(role, text, options);
  }
}

export function setupChat() {
  const form = document.getElementById("chat-form");
  const conversation = new Conversation(document.getElementById("chat-log"));
  const speaker = new Speaker(form.querySelector("button.stop"),
    document.getElementById("chat-status"));

  form.addEventListener("submit", (submitted) => {
    submitted.preventDefault();
    const spoken = form.elements.spoken.checked;
    const text = form.elements.text.value;
    form.elements.text.value = "";
    conversation.add("user", text);
    const answer = conversation.show("assistant", "");
    const body = { model: form.elements.model.value, messages: [...conversation.messages],
      stream: true };
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
      conversation.remember("assistant", answer.textContent);
      answer.parentElement.dataset.complete = "true";
      if (spoken) speaker.status.textContent = "Speaking…";
    }, "Thinking…");
  });
  setupTalk(conversation, form.elements.model);
}
