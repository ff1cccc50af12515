// The playground's entry: the API key prompt, the tabs (WAI-ARIA tabs: arrow keys move between
// them) and the model pickers, filled from GET /v1/models by each recipe's task.

import { ApiError, apiKey, describe, models, setApiKey } from "./api.js";
import { setupChat } from "./chat.js";
import { setupImage } from "./image.js";
import { setupSpeech } from "./speech.js";
import { setupVideo } from "./video.js";

const UNAUTHORIZED = 401;

function setupTabs() {
  const tabs = [...document.querySelectorAll("[role=tab]")];
  function select(tab) {
    for (const other of tabs) {
      const selected = other === tab;
      other.setAttribute("aria-selected", String(selected));
      other.tabIndex = selected ? 0 : -1;
      document.getElementById(other.getAttribute("aria-controls")).hidden = !selected;
    }
    tab.focus();
  }
  for (const [index, tab] of tabs.entries()) {
    tab.addEventListener("click", () => select(tab));
    tab.addEventListener("keydown", (event) => {
      const moves = { ArrowRight: index + 1, ArrowLeft: index - 1, Home: 0, End: tabs.length - 1 };
      if (!(event.key in moves)) return;
      event.preventDefault();
      select(tabs[(moves[event.key] + tabs.length) % tabs.length]);
    });
  }
}

function fillModels(recipes) {
  for (const select of document.querySelectorAll("select[data-task]")) {
    const fitting = recipes.filter((recipe) => recipe.task === select.dataset.task);
    select.replaceChildren(...fitting.map((recipe) => new Option(recipe.id)));
    select.disabled = fitting.length === 0;
    if (!fitting.length) select.append(new Option("(none served)"));
  }
  document.dispatchEvent(new Event("models-loaded"));
}

// Loads the models; a 401 means the gateway checks keys: ask for one, then try again.
async function connect() {
  const keyForm = document.getElementById("key-form");
  try {
    fillModels(await models());
    keyForm.hidden = true;
  } catch (error) {
    if (!(error instanceof ApiError && error.status === UNAUTHORIZED)) {
      document.querySelector("header p").textContent = `The gateway did not answer: ${describe(error)}`;
      return;
    }
    keyForm.hidden = false;
    document.getElementById("key-error").textContent = apiKey() ? "That key was refused." : "";
    document.getElementById("key-input").focus();
  }
}

function setupKey() {
  const keyForm = document.getElementById("key-form");
  keyForm.addEventListener("submit", (submitted) => {
    submitted.preventDefault();
    setApiKey(document.getElementById("key-input").value.trim());
    connect();
  });
}

setupTabs();
setupKey();
setupImage();
setupSpeech();
setupChat();
setupVideo();
connect();
