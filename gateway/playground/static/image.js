// The image and edit tabs: one run view (SSE progress, step previews, the result, Cancel by id)
// over two ways to start a request (a JSON generation, a multipart edit).

import { api, apiJson, describe, isAbort, newRequestId, sseEvents } from "./api.js";

const DENOISER = "dit";

function element(tag, properties = {}) {
  return Object.assign(document.createElement(tag), properties);
}

// What one run shows: a status line, the progress bar, the latest preview and the images.
class RunView {
  constructor(container) {
    container.replaceChildren();
    this.container = container;
    this.status = element("p", { className: "status" });
    this.status.setAttribute("role", "status");
    this.status.setAttribute("aria-live", "polite");
    this.bar = element("progress", { max: 1, value: 0 });
    this.bar.setAttribute("aria-label", "Denoising steps done");
    this.preview = element("img", { className: "preview", hidden: true });
    this.images = element("div", { className: "images" });
    container.append(this.status, this.bar, this.preview, this.images);
    this.total = 0;
    this.step = 0;
    this.setState("running", "Starting…");
  }

  setState(state, text) {
    this.container.dataset.state = state;
    this.status.textContent = text;
  }

  show(event) {
    switch (event.type) {
      case "queued":
        this.status.textContent = `Queued at the ${event.stage} stage (position ${event.position})`;
        break;
      case "preempted":
        this.status.textContent = `Paused at step ${event.step}: a more urgent request runs first`;
        break;
      case "progress":
        this.progress(event);
        break;
      case "image":
        this.image(event);
        break;
      default:
        break;
    }
  }

  progress(event) {
    if (event.stage !== DENOISER) {
      this.status.textContent = `${event.stage}: step ${event.step} of ${event.total_steps}`;
      return;
    }
    this.step = event.step;
    this.total = event.total_steps;
    this.bar.max = event.total_steps;
    this.bar.value = event.step;
    const ms = Math.round((event.step_seconds || 0) * 1000);
    this.status.textContent = `Step ${event.step} of ${event.total_steps} (${ms} ms a step)`;
    if (event.preview) {
      this.preview.src = event.preview;
      this.preview.alt = `Preview of the image at step ${event.step}`;
      this.preview.hidden = false;
    }
  }

  image(event) {
    const src = `data:image/png;base64,${event.b64_json}`;
    const figure = element("figure");
    const img = element("img", { src, alt: `Result ${event.index + 1} (seed ${event.seed})` });
    const link = element("a", { href: src, download: `stagemesh-${event.seed}.png`,
      textContent: `Save (seed ${event.seed})` });
    figure.append(img, element("figcaption"));
    figure.lastChild.append(link);
    this.images.append(figure);
    this.bar.value = this.bar.max;
    this.preview.hidden = true; // the image itself replaces its last preview
  }

  cancelled(ack, waitedMs) {
    const latency = Math.round(ack.abort_latency_seconds * 1000);
    const of = this.total ? ` of ${this.total}` : "";
    this.setState("cancelled", `Cancelled in the ${ack.stage} stage at step ${ack.step_index}${of}:`
      + ` it stopped ${latency} ms after the cancel reached it (${Math.round(waitedMs)} ms`
      + " round trip). Nothing after it ran.");
  }
}

// Wires one tab: its form starts a run with `start(form, requestId, signal)` (a fetch answering
// SSE), its Cancel button cancels the run by id.
function imageTab(form, container, start) {
  const submit = form.querySelector("button[type=submit]");
  const cancel = form.querySelector("button.cancel");
  let current = null;

  cancel.addEventListener("click", async () => {
    const run = current;
    if (!run) return;
    run.cancelling = true;
    cancel.disabled = true;
    const started = performance.now();
    try {
      const ack = await apiJson(`/v1/requests/${encodeURIComponent(run.id)}/cancel`,
        { method: "POST" });
      run.view.cancelled(ack, performance.now() - started);
    } catch (error) {
      run.cancelling = false;
      run.view.status.textContent = `Could not cancel: ${describe(error)}`;
    }
  });

  form.addEventListener("submit", async (submitted) => {
    submitted.preventDefault();
    const run = { id: newRequestId("image"), view: new RunView(container),
      abort: new AbortController(), cancelling: false };
    current = run;
    submit.disabled = true;
    cancel.disabled = false;
    const started = performance.now();
    try {
      const response = await start(new FormData(form), run.id, run.abort.signal);
      for await (const event of sseEvents(response)) {
        if (event.type === "error") throw new Error(event.error.message);
        run.view.show(event);
      }
      const seconds = ((performance.now() - started) / 1000).toFixed(1);
      if (!run.cancelling) run.view.setState("done", `Done in ${seconds} s.`);
    } catch (error) {
      if (!run.cancelling && !isAbort(error)) run.view.setState("failed", describe(error));
    } finally {
      current = null;
      submit.disabled = false;
      cancel.disabled = true;
    }
  });
}

// An optional number field: undefined when empty (the gateway's default applies).
function numberOf(fields, name) {
  const value = fields.get(name);
  return value === "" || value === null ? undefined : Number(value);
}

// Step previews are opt-in per request: `preview: {every: k}` (JSON) or `preview_every`
// (forms); 0 asks for none.
function previewOf(fields) {
  const every = numberOf(fields, "preview_every");
  return every ? { every } : undefined;
}

export function setupImage() {
  imageTab(document.getElementById("image-form"), document.getElementById("image-run"),
    (fields, id, signal) => api("/v1/images/generations", {
      method: "POST", signal, headers: { "x-request-id": id },
      json: { model: fields.get("model"), prompt: fields.get("prompt"), size: fields.get("size"),
        num_inference_steps: Number(fields.get("steps")), seed: numberOf(fields, "seed"),
        preview: previewOf(fields), stream: true },
    }));
  imageTab(document.getElementById("edit-form"), document.getElementById("edit-run"),
    (fields, id, signal) => {
      const body = new FormData();
      for (const name of ["model", "image", "prompt"]) body.append(name, fields.get(name));
      body.append("num_inference_steps", fields.get("steps"));
      if (numberOf(fields, "seed") !== undefined) body.append("seed", fields.get("seed"));
      if (previewOf(fields)) body.append("preview_every", fields.get("preview_every"));
      body.append("stream", "true");
      return api("/v1/images/edits", { method: "POST", signal, form: body,
        headers: { "x-request-id": id } });
    });
}
