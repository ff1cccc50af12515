// The chat tab's microphone: a spoken conversation over the gateway's realtime route
// (GET /v1/realtime: OpenAI's Realtime protocol on a WebSocket). An AudioWorklet
// (mic-worklet.js) turns the microphone into the route's 16-bit PCM at 24 kHz, sent in 100 ms
// `input_audio_buffer.append` events. The gateway's voice activity detection ends each turn;
// the turn's transcript and the answer's text join the conversation while the answer's audio
// plays as it arrives. Talking over an answer stops it: the gateway cancels it in every stage,
// and at `input_audio_buffer.speech_started` this page drops what it had scheduled to play.

import { describe, openSocket } from "./api.js";
import { StreamPlayer, base64Bytes, bytesBase64 } from "./audio.js";

// The route's one audio format, both ways (gateway/realtime/protocol.py: PCM_RATE).
const PCM_RATE = 24000;
const CHUNK_SAMPLES = PCM_RATE / 10;
const WORKLET = "/playground/static/mic-worklet.js";
const PROCESSOR = "pcm16-capture"; // the name mic-worklet.js registers
const CLOSE_NORMAL = 1000;

// Browsers give a page the microphone only in a secure context: https, or localhost.
export function microphoneAllowed() {
  return window.isSecureContext && Boolean(navigator.mediaDevices?.getUserMedia);
}

// What the call shows: its state (on the container, as data-state), a status line, the
// buttons, and a counter of the answer audio it scheduled (data-scheduled-seconds).
class CallView {
  constructor() {
    this.container = document.getElementById("chat-call");
    this.talk = document.getElementById("chat-mic");
    this.hangUp = document.getElementById("chat-hangup");
    this.status = document.getElementById("chat-call-status");
  }

  say(state, text) {
    this.container.dataset.state = state;
    this.status.textContent = text;
  }

  calling(on) {
    this.talk.disabled = on;
    this.hangUp.disabled = !on;
    // the pressed button is disabled: keep the keyboard on the one that now makes sense
    (on ? this.hangUp : this.talk).focus();
  }

  scheduled(seconds) {
    this.container.dataset.scheduledSeconds = seconds.toFixed(2);
  }
}

// One answer: its entry in the conversation, and whether its audio still plays.
class Answer {
  constructor(id, text) {
    this.id = id;
    this.text = text;
    this.audible = true;
  }
}

// One call: the microphone, the socket, the player of the answers.
class Call {
  constructor(view, conversation, model) {
    this.view = view;
    this.conversation = conversation;
    this.model = model;
    this.answer = null;
    this.ended = false;
    // Made in the click handler: the browser lets it capture and play from then on.
    this.context = new AudioContext();
    this.player = new StreamPlayer({ context: this.context, rate: PCM_RATE });
    this.microphone = null;
    this.socket = null;
    this.opened = false;
    this.error = "";
  }

  async start() {
    this.view.say("connecting", "Asking for the microphone…");
    this.microphone = await navigator.mediaDevices.getUserMedia({ audio: {
      channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true } });
    if (this.ended) { // hung up while the browser asked
      this.releaseMicrophone();
      return;
    }
    await this.context.audioWorklet.addModule(WORKLET);
    if (this.ended) return; // (end() released the microphone)
    this.view.say("connecting", "Connecting…");
    this.socket = openSocket(`/v1/realtime?model=${encodeURIComponent(this.model)}`);
    this.socket.addEventListener("open", () => { this.opened = true; });
    this.socket.addEventListener("message", (message) => this.receive(JSON.parse(message.data)));
    this.socket.addEventListener("close", (closed) => this.end(this.closing(closed)));
  }

  // Why the gateway closed the socket, in words: its last error event says it best.
  closing(closed) {
    if (this.error) return `The gateway ended the call: ${this.error}`;
    if (!this.opened) return "The gateway refused the call.";
    return closed.code === CLOSE_NORMAL ? "Call ended." : `The call dropped (${closed.code}).`;
  }

  send(event) {
    if (this.socket?.readyState === WebSocket.OPEN) this.socket.send(JSON.stringify(event));
  }

  // The session opened: it learns the conversation so far (typed turns too), then listens.
  listen() {
    for (const { role, content } of this.conversation.messages) {
      this.send({ type: "conversation.item.create", item: { type: "message", role,
        content: [{ type: role === "assistant" ? "output_text" : "input_text", text: content }] } });
    }
    const capture = new AudioWorkletNode(this.context, PROCESSOR, {
      numberOfInputs: 1, numberOfOutputs: 0, channelCount: 1, channelCountMode: "explicit",
      processorOptions: { rate: PCM_RATE, chunk: CHUNK_SAMPLES } });
    capture.port.onmessage = ({ data }) => this.send({ type: "input_audio_buffer.append",
      audio: bytesBase64(new Uint8Array(data)) });
    this.context.createMediaStreamSource(this.microphone).connect(capture);
    this.view.say("listening", "Listening: ask out loud.");
  }

  receive(event) {
    if (event.type !== "error") this.error = ""; // the error event that ends a call comes last
    switch (event.type) {
      case "session.created":
        this.listen();
        break;
      case "input_audio_buffer.speech_started":
        this.interrupt();
        this.view.say("hearing", "Hearing you…");
        break;
      case "input_audio_buffer.speech_stopped":
        this.view.say("thinking", "Thinking…");
        break;
      case "conversation.item.input_audio_transcription.completed":
        if (event.transcript) this.conversation.add("user", event.transcript, { spoken: true });
        break;
      case "response.created":
        this.answer = new Answer(event.response.id,
          this.conversation.show("assistant", "", { spoken: true }));
        this.view.say("answering", "Answering…");
        break;
      case "response.output_audio_transcript.delta":
        if (this.answer?.id === event.response_id) this.answer.text.textContent += event.delta;
        break;
      case "response.output_audio.delta":
        if (this.answer?.id === event.response_id && this.answer.audible) {
          this.player.feed(base64Bytes(event.delta));
          this.view.scheduled(this.player.scheduledSeconds);
        }
        break;
      case "response.done":
        this.finish(event.response);
        break;
      case "error":
        this.error = event.error.message;
        this.view.status.textContent = this.error;
        break;
      default:
        break;
    }
  }

  // The user speaks over an answer: the gateway stops it; what was scheduled stops here.
  interrupt() {
    this.player.silence();
    if (this.answer) this.answer.audible = false;
  }

  // An answer ended: its entry keeps what was said (a cancelled answer's transcript is cut
  // to the sentences it spoke) and joins the conversation.
  finish(response) {
    if (!this.answer || this.answer.id !== response.id) return;
    const spoken = response.output?.[0]?.content?.[0]?.transcript ?? this.answer.text.textContent;
    this.answer.text.textContent = spoken;
    this.conversation.remember("assistant", spoken);
    const entry = this.answer.text.parentElement;
    entry.dataset.complete = "true";
    if (response.status === "cancelled") {
      entry.dataset.interrupted = "true";
      entry.querySelector("strong").textContent += ", interrupted";
    }
    if (response.status === "failed") {
      this.view.status.textContent = response.status_details?.error?.message ?? "The answer failed.";
    } else if (this.view.container.dataset.state === "answering") { // not heard speaking since
      this.view.say("listening", "Listening: ask out loud.");
    }
    this.answer = null;
  }

  releaseMicrophone() {
    for (const track of this.microphone?.getTracks() ?? []) track.stop();
  }

  // Ends the call, saying `text`: the socket (which stops every stage call of the session), the
  // microphone and the sound.
  end(text) {
    if (this.ended) return;
    this.ended = true;
    this.socket?.close(CLOSE_NORMAL);
    this.releaseMicrophone();
    this.player.stop();
    this.view.say("ended", text);
    this.view.calling(false);
  }
}

export function setupTalk(conversation, model) {
  const view = new CallView();
  let call = null;
  if (!microphoneAllowed()) {
    view.talk.disabled = true;
    view.say("unavailable", "This page is not on localhost or HTTPS, so the browser keeps the"
      + " microphone from it: open it as http://localhost:… or over TLS to talk.");
    return;
  }
  document.addEventListener("models-loaded", () => {
    view.talk.disabled = model.disabled || call?.ended === false; // no chat model served
  });
  view.talk.addEventListener("click", async () => {
    call?.end("Call ended.");
    call = new Call(view, conversation, model.value);
    view.scheduled(0);
    view.calling(true);
    try {
      await call.start();
    } catch (error) {
      call.end(error.name === "NotAllowedError"
        ? "The microphone was refused: allow it for this page to talk."
        : `Could not start the call: ${describe(error)}`);
    }
  });
  view.hangUp.addEventListener("click", () => call?.end("Call ended."));
}
