// The console's only way to the service: the public HTTP API on this page's own origin, with the
// key the user logged in with. Every action the console offers is one of these requests.

const KEY_STORAGE = "engram.console.key";
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

export const session = {
  key: sessionStorage.getItem(KEY_STORAGE),
  identity: null, // GET /whoami: {auth, key, scope}
};

export function setKey(key) {
  session.key = key;
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

/** An answer that is not 2xx, with the service's problem (RFC 9457) when it sent one. */
export class ApiError extends Error {
  constructor(status, problem, method, path) {
    const detail = problem && (problem.detail || problem.title);
    super(detail ? `${status}: ${detail}` : `${method} ${path} answered ${status}`);
    this.status = status;
    this.problem = problem || {};
    this.method = method;
    this.path = path;
  }
  /** The invalid fields of a 422, one line each ("body.alpha: ..."). */
  get fieldErrors() {
    return (this.problem.errors || []).map((e) => `${(e.loc || []).join(".")}: ${e.msg}`);
  }
}

// Called when the key stops being accepted (401): app.js shows the login form again.
let onUnauthorized = () => {};
export function whenUnauthorized(callback) { onUnauthorized = callback; }

// The API's root: where /ui/ is served, so a proxy that mounts the service under a prefix works too.
const API_ROOT = window.location.pathname.replace(/\/ui\/.*$/, "");

export function url(path, query) {
  const target = new URL(API_ROOT + path, window.location.origin);
  for (const [name, value] of Object.entries(query || {})) {
    if (value === undefined || value === null || value === "") continue;
    for (const item of Array.isArray(value) ? value : [value]) target.searchParams.append(name, String(item));
  }
  return target.pathname + target.search;
}

/**
 * One request. `json` sends a JSON body, `form` a FormData (multipart); `query` adds parameters.
 * Resolves to {status, data, headers}; rejects with ApiError for any status >= 400.
 */
export async function request(method, path, { query, json, form, headers, as = "json" } = {}) {
  const init = { method, headers: { ...(headers || {}) } };
  if (session.key) init.headers.Authorization = `Bearer ${session.key}`;
  if (json !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(json);
  } else if (form !== undefined) {
    init.body = form;
  }
  const target = url(path, query);
  const response = await fetch(target, init);
  if (response.status >= 400) {
    let problem = null;
    try { problem = await response.json(); } catch { problem = null; }
    if (response.status === 401) onUnauthorized();
    throw new ApiError(response.status, problem, method, target);
  }
  let data = null;
  if (response.status !== 204) {
    if (as === "blob") data = await response.blob();
    else if (as === "text") data = await response.text();
    else data = (response.headers.get("content-type") || "").includes("json") ? await response.json() : await response.text();
  }
  return { status: response.status, data, headers: response.headers };
}

export async function get(path, query) { return (await request("GET", path, { query })).data; }
export async function post(path, json, query) { return (await request("POST", path, { json, query })).data; }
export async function del(path, query) { return (await request("DELETE", path, { query })).data; }

/** One page of a paged list: {items, next} (next: the cursor of the following page, or null). */
export async function page(path, query) {
  const answer = await request("GET", path, { query });
  return { items: answer.data, next: answer.headers.get("X-Next-Cursor") };
}

/** Every item of a paged list, following X-Next-Cursor up to `max` items. */
export async function all(path, query = {}, max = 2000) {
  const items = [];
  let cursor = null;
  do {
    const { items: batch, next } = await page(path, { ...query, cursor, limit: Math.min(500, max) });
    items.push(...batch);
    cursor = next;
  } while (cursor && items.length < max);
  return items;
}

/** An object URL of bytes the key may read (an image, a file): <img src> cannot send a bearer key. */
export async function objectUrl(path, query) {
  const blob = (await request("GET", path, { query, as: "blob" })).data;
  return URL.createObjectURL(blob);
}

/** Save bytes the key may read as a file named `filename` (the browser's download). */
export async function download(path, filename, query) {
  const href = await objectUrl(path, query);
  const link = document.createElement("a");
  link.href = href;
  link.download = filename;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(href), 60_000);
}

export function isFinished(job) { return TERMINAL.has(job.status); }

/**
 * Poll GET /jobs/{id} until it finishes, calling onUpdate with each state; resolves to the last.
 * `alive()` returning false (the user left the page) stops the polling early.
 */
export async function followJob(jobId, onUpdate = () => {}, { intervalMs = 1000, alive = () => true } = {}) {
  for (;;) {
    const job = await get(`/jobs/${encodeURIComponent(jobId)}`);
    onUpdate(job);
    if (isFinished(job) || !alive()) return job;
    await new Promise((resolve) => setTimeout(resolve, intervalMs));
  }
}
