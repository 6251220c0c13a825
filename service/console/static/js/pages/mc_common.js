// What the models and concepts pages share: labels typed as text, paged tables, live job progress,
// an engram map drawn from its PNG route (following the map's job when it answers 202), and a
// refusal shown with what it names (a 409's dependents).
import { ApiError, followJob, page as listPage, request } from "../api.js";
import { badge, fill, fmtNum, h, link, problemBox, table } from "../ui.js";

/**
 * "ticket=T-42, owner=ml" (or key:value) as the labels object the API takes; "" is null (no labels).
 * A pair without a key is an Error naming it: the form shows it instead of sending anything.
 */
export function parseLabels(text) {
  const pairs = String(text || "").split(/[,\n]/).map((p) => p.trim()).filter(Boolean);
  if (!pairs.length) return null;
  const labels = {};
  for (const pair of pairs) {
    const at = pair.search(/[=:]/);
    if (at <= 0) throw new Error(`label "${pair}" is not key=value (e.g. ticket=T-42)`);
    labels[pair.slice(0, at).trim()] = pair.slice(at + 1).trim();
  }
  return labels;
}

/** "a, b,c" as ["a", "b", "c"]; "" is null (the API's default). */
export function csv(text) {
  const items = String(text || "").split(",").map((s) => s.trim()).filter(Boolean);
  return items.length ? items : null;
}

/** Labels as small tags (key=value), or a dash. */
export function labelTags(labels) {
  const entries = Object.entries(labels || {});
  if (!entries.length) return h("span", { class: "muted" }, "—");
  return h("span", { class: "labels" }, entries.map(([k, v]) => h("span", { class: "label-tag" }, `${k}=${v}`)));
}

/** The values chosen in a <select multiple>. */
export function chosen(select) { return [...select.selectedOptions].map((o) => o.value); }

/** A job's state on one line: status, a bar whose width JS sets (CSP forbids style attributes), counts, link. */
export function jobLine(job) {
  const p = job.progress || {};
  const fraction = p.total ? (p.done || 0) / p.total : job.status === "succeeded" ? 1 : 0;
  const inner = h("div", {});
  inner.style.width = `${Math.round(100 * Math.min(1, fraction))}%`;
  return h("span", { class: "job-line", "data-testid": "job-line", "data-job": job.job_id, "data-status": job.status },
    badge(job.status), h("span", { class: "mc-progress", "data-fraction": fraction.toFixed(3) }, inner),
    h("span", { class: "muted" }, `${p.done || 0}/${p.total || 0} ${p.unit || ""}`),
    link(`#/jobs/${encodeURIComponent(job.job_id)}`, job.job_id));
}

/** A refusal as the user should read it, with each dependent a 409 names (kind: ids). */
export function refusal(error) {
  const box = problemBox(error);
  const dependents = error instanceof ApiError ? error.problem.dependents : null;
  if (dependents && typeof dependents === "object") {
    box.append(h("ul", { class: "dependents" },
      Object.entries(dependents).map(([kind, ids]) => h("li", {}, `${kind}: ${[].concat(ids).join(", ")}`))));
  }
  return box;
}

/**
 * A table over a paged list (X-Next-Cursor): `columns` as ui.table's; "Newer/Older" buttons walk the
 * cursors. Returns {node, reload} (reload: the current page again, e.g. while something collects).
 */
export function pagedTable(path, query, columns, { testid, rowId, empty, limit = 50, onItems } = {}) {
  const node = h("div", { class: "paged" });
  const cursors = [null]; // the cursor of each page seen so far: the last is the page shown
  let shown = null; // what was drawn: a reload that finds the same page leaves the DOM alone
  const reload = async () => {
    const { items, next } = await listPage(path, { ...query, limit, cursor: cursors.at(-1) });
    if (onItems) onItems(items);
    const text = JSON.stringify([cursors, items, next]);
    if (text === shown) return items;
    shown = text;
    const prev = h("button", { type: "button", class: "secondary", disabled: cursors.length < 2 }, "Previous page");
    const more = h("button", { type: "button", class: "secondary", disabled: !next, "data-testid": testid ? `${testid}-next` : null }, "Next page");
    prev.addEventListener("click", () => { cursors.pop(); reload(); });
    more.addEventListener("click", () => { cursors.push(next); reload(); });
    fill(node, table(columns, items, { testid, rowId, empty }),
      cursors.length > 1 || next ? h("div", { class: "toolbar pager" }, prev, more) : null);
    return items;
  };
  return { node, reload };
}

const MAP_POLL_MS = 1000;

/** GET the map's PNG once: {url} when it is stored, {job} while its job computes it (a 202). */
async function mapOnce(modelId, concepts) {
  const path = `/models/${modelId.split("/").map(encodeURIComponent).join("/")}/engram-map.png`;
  // wait=0: a 202 comes at once, so the page shows the job's progress instead of a silent 30 s.
  const answer = await request("GET", path, { query: { concepts: concepts.join(","), wait: 0 }, as: "blob" });
  if (answer.status === 202) return { job: JSON.parse(await answer.data.text()) };
  return { url: URL.createObjectURL(answer.data) };
}

/**
 * Draw the engram map of `concepts` on `modelId` into `target`: the image when stored, else the
 * map job's live progress and then the image. A refusal (a read key asking for a map nobody
 * computed yet: 403) is shown as the service words it. `alive()` stops following when the user left.
 */
export async function drawMap(target, modelId, concepts, alive, testid = "engram-map") {
  if (!concepts.length) { fill(target, h("p", { class: "muted" }, "Choose at least one ready concept.")); return; }
  fill(target, h("p", { class: "muted" }, "Asking for the map…"));
  try {
    let answer = await mapOnce(modelId, concepts);
    if (answer.job) {
      const job = await followJob(answer.job.job_id, (j) => fill(target, h("p", {}, "Computing the map: "), jobLine(j)),
        { intervalMs: MAP_POLL_MS, alive });
      if (!alive()) return;
      if (job.status !== "succeeded") { fill(target, h("div", { class: "problem", "data-testid": "problem" }, (job.error && job.error.detail) || `the map's job ${job.status}`)); return; }
      answer = await mapOnce(modelId, concepts);
      if (answer.job) { fill(target, h("p", { class: "muted" }, "The map is still being computed: draw it again.")); return; }
    }
    const image = h("img", { class: "figure engram-map", alt: `engram map of ${concepts.join(", ")} on ${modelId}`, "data-testid": testid });
    image.addEventListener("load", () => setTimeout(() => URL.revokeObjectURL(answer.url), 1000), { once: true });
    image.src = answer.url;
    fill(target, image);
  } catch (error) {
    fill(target, refusal(error));
  }
}

/** A concept's collection on one model, as a cell: the state's badge and its tokens once ready. */
export function stateCell(state) {
  if (!state) return h("span", { class: "muted" }, "—");
  return h("span", {}, badge(state.status), state.tokens ? h("span", { class: "muted" }, ` ${fmtNum(state.tokens)} tokens`) : null);
}

/** Model IDs are paths (demo/tiny-llama): each segment is encoded, the slashes stay. */
export function modelPath(modelId) { return modelId.split("/").map(encodeURIComponent).join("/"); }

/** Whether any of a concept's collections is still under way (the page keeps polling then). */
export function collecting(concept) {
  return Object.values(concept.models || {}).some((s) => s.status === "pending" || s.status === "collecting");
}
