// The video tab: jobs (create, progress, play, delete). Jobs run on the gateway whether or not
// this page is open; the list is polled while one of them is still running.

import { api, apiJson, blobUrl, describe } from "./api.js";

const POLL_MS = 1000;
const RUNNING = new Set(["queued", "in_progress"]);

function button(text, label, onClick) {
  const made = document.createElement("button");
  made.type = "button";
  made.textContent = text;
  made.setAttribute("aria-label", label);
  made.addEventListener("click", onClick);
  return made;
}

export function setupVideo() {
  const form = document.getElementById("video-form");
  const list = document.getElementById("video-jobs");
  const status = document.getElementById("video-status");
  const player = document.getElementById("video-player");
  let timer = null;

  async function play(job) {
    try {
      if (player.src) URL.revokeObjectURL(player.src);
      player.src = await blobUrl(`/v1/videos/${job.id}/content`);
      player.hidden = false;
      player.setAttribute("aria-label", `Video: ${job.prompt}`);
      await player.play().catch(() => {}); // autoplay may be refused: the controls remain
    } catch (error) {
      status.textContent = describe(error);
    }
  }

  async function remove(job) {
    try {
      await api(`/v1/videos/${job.id}`, { method: "DELETE" });
      status.textContent = RUNNING.has(job.status) ? "Stopped and deleted." : "Deleted.";
    } catch (error) {
      status.textContent = describe(error);
    }
    refresh();
  }

  function row(job) {
    const item = document.createElement("li");
    item.dataset.status = job.status;
    const title = document.createElement("span");
    title.textContent = `${job.prompt} (${job.size}, ${job.num_frames} frames): ${job.status}`
      + (job.error ? ` (${job.error.message})` : "");
    const bar = document.createElement("progress");
    bar.max = 100;
    bar.value = job.progress;
    bar.setAttribute("aria-label", `Progress of "${job.prompt}"`);
    item.append(title, bar);
    if (job.status === "completed") item.append(button("Play", `Play "${job.prompt}"`, () => play(job)));
    item.append(button("Delete", `Delete "${job.prompt}"`, () => remove(job)));
    return item;
  }

  async function refresh() {
    clearTimeout(timer);
    try {
      const { data } = await apiJson("/v1/videos");
      list.replaceChildren(...data.map(row));
      if (data.some((job) => RUNNING.has(job.status))) timer = setTimeout(refresh, POLL_MS);
    } catch (error) {
      status.textContent = describe(error);
    }
  }

  form.addEventListener("submit", async (submitted) => {
    submitted.preventDefault();
    try {
      await api("/v1/videos", { method: "POST", form: new FormData(form) });
      status.textContent = "Job created.";
    } catch (error) {
      status.textContent = describe(error);
    }
    refresh();
  });
  document.getElementById("tab-video").addEventListener("click", refresh);
}
