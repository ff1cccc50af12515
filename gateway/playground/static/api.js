// Every call the page makes to the gateway goes through here, so each one carries the key the
// user typed (kept in this tab's session storage only, never in local storage or a cookie).

const KEY_ITEM = "stagemesh.apiKey";

export function apiKey() {
  return sessionStorage.getItem(KEY_ITEM) || "";
}

export function setApiKey(key) {
  sessionStorage.setItem(KEY_ITEM, key);
}

// A WebSocket to the gateway (the realtime route). A page cannot set headers on one, so the key
// rides in the subprotocol the gateway reads it from (as OpenAI's browser clients send it);
// "realtime" is offered too, since a browser drops a handshake whose answer names none.
const KEY_SUBPROTOCOL = "openai-insecure-api-key.";
const REALTIME_SUBPROTOCOL = "realtime";

export function openSocket(path) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const key = apiKey();
  const protocols = [REALTIME_SUBPROTOCOL, ...(key ? [KEY_SUBPROTOCOL + key] : [])];
  return new WebSocket(`${scheme}//${location.host}${path}`, protocols);
}

// The gateway's one error body ({"error": {"message", ...}}) as an Error, or the status line.
export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export async function api(path, { method = "GET", json, form, headers = {}, signal } = {}) {
  const init = { method, signal, headers: { ...headers } };
  const key = apiKey();
  if (key) init.headers.authorization = `Bearer ${key}`;
  if (json !== undefined) {
    init.headers["content-type"] = "application/json";
    init.body = JSON.stringify(json);
  } else if (form !== undefined) {
    init.body = form;
  }
  const response = await fetch(path, init);
  if (!response.ok) throw await errorOf(response);
  return response;
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = "";
  try {
    const body = await response.json();
    if (body.error) ({ message, code } = body.error);
  } catch {
    // not the gateway's JSON error body: keep the status line
  }
  return new ApiError(response.status, message, code);
}

export async function apiJson(path, options) {
  return (await api(path, options)).json();
}

// Server-sent events of a fetch response, as parsed JSON objects (fetch, not EventSource: the
// calls are POSTs and carry a key header). Stops at `data: [DONE]`.
export async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((line) => line.startsWith("data: "))
        .map((line) => line.slice(6)).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

// Media the browser cannot fetch with a header (<video>, <audio>): fetched here with the key,
// then played from memory.
export async function blobUrl(path) {
  const response = await api(path);
  return URL.createObjectURL(await response.blob());
}

// (getRandomValues, not randomUUID: the page may be served over plain HTTP on a LAN address,
// where randomUUID does not exist.)
export function newRequestId(kind) {
  const bytes = crypto.getRandomValues(new Uint8Array(12));
  const hex = Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  return `playground-${kind}-${hex}`;
}

// The recipes of the gateway, for the model pickers: [{id, task}].
export async function models() {
  return (await apiJson("/v1/models")).data;
}

export function isAbort(error) {
  return error instanceof DOMException && error.name === "AbortError";
}

export function describe(error) {
  return error instanceof Error ? error.message : String(error);
}
