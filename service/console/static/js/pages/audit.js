// The audit log (admin keys only: GET /audit answers 403 to others, and the nav hides the link): every
// state-changing request, oldest first, paged, filtered by time, key fingerprint, method, path and status.
// The log holds key fingerprints (key-…), never a key; this page shows only what it answers.
import { page as listPage } from "../api.js";
import { badge, fill, fmtTime, h, problemBox, table } from "../ui.js";

const METHODS = ["POST", "PUT", "PATCH", "DELETE"];
const FILTERS = ["since", "until", "key", "method", "path_prefix", "status"];

function outcome(entry) {
  if (entry.status < 400) {
    const named = Object.entries(entry.resources || {}).map(([k, v]) => `${k} ${v}`).join(", ");
    return h("span", {}, badge("ok"), named ? ` ${named}` : "");
  }
  return h("span", {}, badge("failed"), ` ${entry.problem || ""}`);
}

const COLUMNS = [
  { label: "time", value: (e) => fmtTime(e.at) },
  { label: "key", value: (e) => h("span", { class: "mono", "data-testid": "audit-key" }, e.key || "— (no valid key)") },
  { label: "scope", value: (e) => e.scope || "—" },
  { label: "method", value: (e) => e.method },
  { label: "path", value: (e) => h("span", { class: "mono audit-path", "data-testid": "audit-path" }, e.path) },
  { label: "status", value: (e) => String(e.status), num: true },
  { label: "request id", value: (e) => h("span", { class: "mono audit-rid" }, e.request_id) },
  { label: "outcome", value: outcome },
  { label: "ms", value: (e) => e.duration_ms.toFixed(0), num: true },
];

function input(name, attrs) { return h("input", { name, "data-testid": `audit-${name}`, ...attrs }); }

/** A datetime-local value (the browser's zone) as the ISO time the API reads; "" stays "". */
function iso(local) { return local ? new Date(local).toISOString() : ""; }

function filterForm(query) {
  const form = h("form", { class: "toolbar", "data-testid": "audit-filters" },
    h("label", {}, "since", input("since", { type: "datetime-local", value: query.since_local || "" })),
    h("label", {}, "until", input("until", { type: "datetime-local", value: query.until_local || "" })),
    h("label", {}, "key fingerprint", input("key", { value: query.key || "", placeholder: "key-0123abcd4567", size: 18 })),
    h("label", {}, "method", h("select", { name: "method", "data-testid": "audit-method" }, h("option", { value: "" }, "any"),
      METHODS.map((m) => h("option", { value: m, selected: m === query.method }, m)))),
    h("label", {}, "path starts with", input("path_prefix", { value: query.path_prefix || "", placeholder: "/models", size: 22 })),
    h("label", {}, "status", input("status", { type: "number", min: 100, max: 599, value: query.status || "", size: 5 })),
    h("button", { type: "submit", "data-testid": "audit-filter" }, "Filter"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const data = Object.fromEntries(new FormData(form));
    // The hash keeps the local times the form shows; the request sends them as UTC ISO times.
    const chosen = { ...data, since_local: data.since, until_local: data.until, since: undefined, until: undefined };
    const pairs = Object.entries(chosen).filter(([, v]) => v);
    window.location.hash = `#/audit?${new URLSearchParams(pairs)}`;
  });
  return form;
}

function apiQuery(query) {
  const wanted = Object.fromEntries(FILTERS.map((name) => [name, query[name] || null]));
  return { ...wanted, since: iso(query.since_local), until: iso(query.until_local), cursor: query.cursor || null, limit: 200 };
}

async function auditLog(view, _params, query) {
  const body = h("div", {});
  fill(view, h("h1", {}, "Audit log"), h("p", { class: "muted" }, "Every state-changing request, oldest first: keys appear only as fingerprints."), filterForm(query), body);
  try {
    const answer = await listPage("/audit", apiQuery(query));
    const next = answer.next ? h("a", { href: `#/audit?${new URLSearchParams({ ...query, cursor: answer.next })}`, "data-testid": "audit-next" }, "Next (newer) page") : null;
    fill(body, table(COLUMNS, answer.items, { testid: "audit", rowId: (e) => e.request_id, empty: "No request matches." }), next);
  } catch (error) {
    fill(body, problemBox(error));
  }
}

export const routes = { audit: auditLog };
