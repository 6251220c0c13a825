// The console's shell: login, navigation and a hash router (#/section/id?query). Each page module
// exports `routes`, a map from a pattern ("variants/:id") to `async (view, params, query, page) => void`;
// `page.every(ms, fn)` polls until the user navigates away, `page.alive()` says whether they have.
import { get, session, setKey, whenUnauthorized } from "./api.js";
import { fill, h, problemBox, toast } from "./ui.js";
import * as audit from "./pages/audit.js";
import * as calibrations from "./pages/calibrations.js";
import * as concepts from "./pages/concepts.js";
import * as jobs from "./pages/jobs.js";
import * as models from "./pages/models.js";
import * as variants from "./pages/variants.js";

const ROUTES = Object.entries({
  ...models.routes, ...concepts.routes, ...variants.routes, ...calibrations.routes, ...jobs.routes, ...audit.routes,
}).map(([pattern, render]) => ({ parts: pattern.split("/"), render }));

const view = document.getElementById("view");
let current = null; // the page being shown: {alive, timers}

function match(path) {
  const parts = path.split("/").filter(Boolean);
  for (const route of ROUTES) {
    if (route.parts.length !== parts.length) continue;
    const params = {};
    const ok = route.parts.every((part, i) => {
      if (part.startsWith(":")) { params[part.slice(1)] = decodeURIComponent(parts[i]); return true; }
      return part === parts[i];
    });
    if (ok) return { render: route.render, params };
  }
  return null;
}

function leave() {
  if (!current) return;
  current.isAlive = false;
  current.timers.forEach(clearInterval);
}

async function show() {
  leave();
  if (!session.identity) return;
  const [path, search] = (window.location.hash.replace(/^#\/?/, "") || "models").split("?");
  const query = Object.fromEntries(new URLSearchParams(search || ""));
  const section = path.split("/")[0];
  document.querySelectorAll("#nav a").forEach((a) => a.classList.toggle("active", a.dataset.section === section));
  const found = match(path);
  const page = {
    isAlive: true,
    timers: [],
    alive() { return this.isAlive; },
    every(ms, fn) { this.timers.push(setInterval(() => { if (this.isAlive) fn(); }, ms)); },
  };
  current = page;
  if (!found) { fill(view, h("h1", {}, "Not found"), h("p", {}, `No console page at #/${path}.`)); return; }
  fill(view, h("p", { class: "muted" }, "Loading…"));
  try {
    await found.render(view, found.params, query, page);
  } catch (error) {
    if (page.isAlive) fill(view, h("h1", {}, "Could not load this page"), problemBox(error));
  }
}

function showIdentity() {
  const id = session.identity;
  document.getElementById("identity").textContent = id.auth ? `${id.key} · ${id.scope}` : "no auth · admin";
  document.getElementById("logout").hidden = !id.auth;
  document.querySelectorAll("#nav a[data-scope]").forEach((a) => { a.hidden = id.scope !== a.dataset.scope && id.scope !== "admin"; });
}

function showLogin(message) {
  leave();
  session.identity = null;
  const form = document.getElementById("login-template").content.cloneNode(true);
  fill(view, form);
  const error = document.getElementById("login-error");
  if (message) { error.textContent = message; error.hidden = false; }
  document.getElementById("login-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    setKey(document.getElementById("login-key").value.trim());
    await start();
  });
}

/** Ask the service who the stored key is (or whether it needs one), then show the page. */
async function start() {
  const hadKey = Boolean(session.key);
  try {
    session.identity = await get("/whoami");
  } catch (error) {
    if (error.status !== 401) { fill(view, h("h1", {}, "The service did not answer"), problemBox(error)); return; }
    setKey(null);
    showLogin(hadKey ? "The service refused this key (401): check it against ENGRAM_API_KEYS." : "");
    return;
  }
  showIdentity();
  await show();
}

whenUnauthorized(() => {
  if (!session.identity) return;
  setKey(null);
  toast("The service no longer accepts this key: log in again.", "error");
  showLogin("The key was refused (401).");
});
document.getElementById("logout").addEventListener("click", () => { setKey(null); showLogin(); });
window.addEventListener("hashchange", show);
start();
