// Small DOM helpers shared by the pages: elements, tables, badges, numbers, buttons that respect the
// key's scope. No framework: the pages build their DOM with h() and replace it when data changes.
import { ApiError, session } from "./api.js";

const RANK = { read: 0, write: 1, admin: 2 };

/**
 * h("a", {href: "#/x", class: "c", onclick: fn, "data-testid": "t"}, "text", child...)
 * Props starting with "on" are listeners; `style` is an object ({width: "40%"}); null/undefined/false
 * props and children are dropped.
 */
export function h(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") node.addEventListener(name.slice(2), value);
    else if (name === "class") node.className = value;
    // CSSOM, never a style attribute: the CSP (style-src 'self') blocks inline style attributes.
    else if (name === "style") Object.assign(node.style, value);
    else if (name === "text") node.textContent = value;
    else if (name in node && typeof value !== "string") node[name] = value;
    else node.setAttribute(name, value === true ? "" : value);
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** Replace everything in `node` with `children`. */
export function fill(node, ...children) {
  node.replaceChildren();
  append(node, children);
  return node;
}

/** Whether the logged-in key has at least `scope` (read < write < admin). */
export function can(scope) {
  const mine = session.identity ? session.identity.scope : "read";
  return RANK[mine] >= RANK[scope];
}

/**
 * A table: columns are {label, value: row => node|string, num?: true, key?: testid suffix}.
 * `rowId` (row => string) sets each row's data-id, which tests and links use.
 */
export function table(columns, rows, { empty = "Nothing yet.", testid, rowId } = {}) {
  if (!rows.length) return h("p", { class: "muted", "data-testid": testid ? `${testid}-empty` : null }, empty);
  const head = h("tr", {}, columns.map((c) => h("th", { class: c.num ? "num" : null }, c.label)));
  const body = rows.map((row) =>
    h("tr", { "data-id": rowId ? rowId(row) : null }, columns.map((c) => h("td", { class: c.num ? "num" : null }, c.value(row)))),
  );
  return h("table", { "data-testid": testid }, h("thead", {}, head), h("tbody", {}, body));
}

export function badge(status) {
  return h("span", { class: `badge ${status || ""}`, "data-status": status || "" }, status || "—");
}

/** A job's progress bar and its message, from the Job schema's progress field. */
export function progressBar(job) {
  const p = job.progress || {};
  const fraction = typeof p.fraction === "number" ? p.fraction
    : p.total ? (p.done || 0) / p.total
    : job.status === "succeeded" ? 1 : 0;
  return h("div", { class: "progress", title: p.message || "", "data-fraction": fraction.toFixed(3) },
    h("div", { style: { width: `${Math.round(100 * fraction)}%` } }));
}

export function link(href, text) { return h("a", { href }, text); }

export function fmtTime(iso) {
  if (!iso) return "—";
  const date = new Date(iso);
  return Number.isNaN(date.getTime()) ? String(iso) : date.toLocaleString(undefined, { hour12: false });
}

export function fmtNum(x, digits = 3) {
  if (x === null || x === undefined) return "—";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return String(x);
  const magnitude = Math.abs(x);
  return magnitude !== 0 && (magnitude < 1e-3 || magnitude >= 1e5) ? x.toExponential(2) : x.toFixed(digits);
}

export function fmtPct(x) { return x === null || x === undefined ? "—" : `${(100 * x).toFixed(1)}%`; }

export function fmtBytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n, unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return `${value.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}

/** A definition list of [label, value] pairs (values: strings or nodes). */
export function kv(pairs) {
  return h("dl", { class: "kv" }, pairs.filter(Boolean).map(([k, v]) => [h("dt", {}, k), h("dd", {}, v ?? "—")]));
}

export function json(value) { return h("pre", { class: "json" }, JSON.stringify(value, null, 2)); }

export function toast(message, kind = "info") {
  const node = h("div", { class: `toast ${kind}`, role: kind === "error" ? "alert" : "status" }, message);
  document.getElementById("toasts").append(node);
  setTimeout(() => node.remove(), kind === "error" ? 12_000 : 5_000);
}

/** An error as the user should read it: the service's detail and each invalid field. */
export function problemBox(error) {
  const lines = error instanceof ApiError ? [error.message, ...error.fieldErrors] : [String(error && error.message || error)];
  return h("div", { class: "problem", role: "alert", "data-testid": "problem" }, lines.join("\n"));
}

/**
 * A button for an action that needs `scope`: disabled, with a title saying why, for a smaller key.
 * While `action` runs the button is disabled; a failure shows the service's problem as a toast.
 */
export function actionButton(label, scope, action, { kind, testid } = {}) {
  const allowed = can(scope);
  const button = h("button", {
    type: "button",
    class: kind || null,
    "data-testid": testid || null,
    "data-scope": scope,
    disabled: !allowed,
    title: allowed ? null : `needs ${scope === "admin" ? "an" : "a"} ${scope} key`,
  }, label);
  button.addEventListener("click", async () => {
    button.disabled = true;
    try {
      await action();
    } catch (error) {
      toast(error.message, "error");
    } finally {
      button.disabled = !can(scope);
    }
  });
  return button;
}

/** Ask before something that cannot be undone (a delete). */
export function confirmed(question) { return window.confirm(question); }

/** A section with a heading. */
export function section(title, ...children) { return h("section", { class: "card" }, h("h2", {}, title), ...children); }

/** A "loading" placeholder that a page replaces. */
export function loading() { return h("p", { class: "muted" }, "Loading…"); }
