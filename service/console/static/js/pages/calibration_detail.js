// One calibration (GET /calibrations/{id}): live status while its job runs; once done, the
// recommendation and its warnings, the interactive front (calibration_front.js), the search's cost,
// the held-out checks, the server-drawn front PNG, and its deletion (admin: DELETE /calibrations/{id}).
import { del, get, isFinished, objectUrl } from "../api.js";
import { actionButton, badge, confirmed, fill, fmtNum, fmtPct, h, json, kv, link, problemBox, section, table } from "../ui.js";
import { frontSection } from "./calibration_front.js";

const POLL_MS = 1500;

function path(id) { return `/calibrations/${encodeURIComponent(id)}`; }
function variantLink(id) { return link(`#/variants/${encodeURIComponent(id)}`, id); }

/** A progress bar whose width is set through element.style (the CSP forbids style attributes). */
function bar(job) {
  const p = job.progress || {};
  const fraction = p.total ? (p.done || 0) / p.total : job.status === "succeeded" ? 1 : 0;
  const fillNode = h("div", {});
  fillNode.style.width = `${Math.round(100 * fraction)}%`;
  return h("div", { class: "progress", "data-testid": "calibration-progress", "data-fraction": fraction.toFixed(3) }, fillNode);
}

function deleteButton(id) {
  return actionButton("Delete", "admin", async () => {
    if (!confirmed(`Delete calibration ${id}? Its recommended variant and its job's record stay.`)) return;
    await del(path(id));
    window.location.hash = "#/calibrations";
  }, { kind: "danger", testid: "delete-calibration" });
}

function subject(cal) {
  return kv([
    ["model", link(`#/models/${encodeURIComponent(cal.model_id)}`, cal.model_id)],
    ["concepts", h("span", {}, cal.concepts.map((c, i) => [i ? ", " : "", link(`#/concepts/${encodeURIComponent(c)}`, c)]))],
    ["universe", h("span", { class: "mono" }, cal.universe_id)],
    ["job", cal.job_id ? link(`#/jobs/${encodeURIComponent(cal.job_id)}`, cal.job_id) : "—"],
  ]);
}

/** While the job runs: its status and progress, polled until it finishes; then the whole page. */
async function followRunning(view, cal, page, render) {
  const live = h("div", { class: "toolbar" });
  fill(view, h("h1", {}, `Calibration ${cal.calibration_id}`), live, section("Subject", subject(cal)));
  for (;;) {
    const job = cal.job_id ? await get(`/jobs/${encodeURIComponent(cal.job_id)}`) : null;
    if (!page.alive()) return;
    if (job) {
      const p = job.progress || {};
      fill(live, badge(job.status), bar(job), h("span", { class: "muted", "data-testid": "calibration-progress-text" }, `${p.done || 0}/${p.total || "?"} ${p.unit || ""} ${p.message || ""}`));
    }
    if (!job || isFinished(job)) break;
    await new Promise((resolve) => setTimeout(resolve, POLL_MS));
  }
  await render(await get(path(cal.calibration_id)));
}

function goal(result) {
  if (result.objective) return `${result.objective.sense} ${result.objective.metric}`;
  return Object.entries(result.constraint || {}).map(([k, v]) => `${k} ${fmtNum(v)}`).join(", ") || "—";
}

function constraintsTable(constraints) {
  if (!constraints || !constraints.length) return null;
  return table([
    { label: "metric", value: (c) => c.metric }, { label: "min", value: (c) => fmtNum(c.min), num: true },
    { label: "max", value: (c) => fmtNum(c.max), num: true }, { label: "base", value: (c) => fmtNum(c.base), num: true },
  ], constraints, { testid: "constraints" });
}

function recommendation(result) {
  const r = result.recommended;
  const warnings = (result.warnings || []).map((w) => h("div", { class: "warning", "data-testid": "calibration-warning" }, w));
  if (!r) return section("Recommendation", h("div", { class: "problem", "data-testid": "no-recommendation" }, result.note || "no candidate is feasible"), warnings);
  const o = r.options;
  return section("Recommendation",
    kv([
      ["candidate", `${r.candidate} ★`], ["α", fmtNum(o.alpha)], ["scaling", o.scaling], ["module set", o.module_set],
      ["layers", o.layers ? o.layers.join(", ") : "every block"], ["modules", o.modules ? o.modules.join(", ") : "every layer"],
      ["forget / retain NLL ratio", `×${fmtNum(r.forget_nll_ratio)} / ×${fmtNum(r.retain_nll_ratio)}`],
      ["forget / retain exact match", `${fmtPct(r.forget_exact_match)} / ${fmtPct(r.retain_exact_match)}`],
      ["variant", h("span", { "data-testid": "recommended-variant" }, variantLink(r.variant_id), ` (${r.format})`)],
    ]),
    warnings.length ? h("div", {}, h("h3", {}, "Warnings"), warnings) : h("p", { class: "muted" }, "No warnings."));
}

function cost(result) {
  const s = result.seconds || {};
  return section("Search",
    kv([
      ["goal", goal(result)], ["candidates", `${result.evaluations} of a budget of ${result.budget} (stopped: ${result.stopped})`],
      ["a full grid would take", `${result.grid_equivalent} candidates`],
      ["seconds", `search ${fmtNum(s.search, 1)} s · ${fmtNum(s.per_candidate, 2)} s per candidate · ${fmtNum(s.total, 1)} s in all`],
      ["α range", (result.alpha_range || []).map((a) => fmtNum(a)).join(" – ")], ["arms", result.arms.join(", ")],
      result.pruned_arms.length ? ["pruned arms", result.pruned_arms.join(", ")] : null,
      result.unexplored_arms.length ? ["unexplored arms", result.unexplored_arms.join(", ")] : null,
    ]),
    constraintsTable(result.constraints));
}

function heldOut(result) {
  const held = result.held_out;
  if (!held) return null;
  const names = [...new Set([...Object.keys(held.base || {}), ...Object.keys(held.recommended || {})])].sort();
  return section("Held-out check",
    h("p", { "data-testid": "held-out-verdict", class: held.feasible ? "" : "problem" },
      held.feasible ? "The recommended variant meets every bound on the held-out probes." : "The recommended variant misses a bound on the held-out probes."),
    kv([
      ["probes held out", Object.entries(held.probes).map(([k, v]) => `${k} ${v}`).join(", ")],
      ["candidate checked", held.candidate ?? "—"], ["rejected first", held.rejected.length ? held.rejected.join(", ") : "none"],
      ["margins", Object.entries(held.margins || {}).map(([k, v]) => `${k} ${fmtNum(v, 4)}`).join(", ") || "—"],
    ]),
    table([{ label: "metric", value: (n) => n }, { label: "base", value: (n) => fmtNum(held.base[n], 4), num: true },
      { label: "recommended", value: (n) => fmtNum(held.recommended[n], 4), num: true }], names, { testid: "held-out" }));
}

async function frontPng(id, page) {
  const holder = h("div", { "data-testid": "front-png-holder" }, h("p", { class: "muted" }, "Loading the drawn front…"));
  objectUrl(`${path(id)}/front.png`)
    .then((src) => { if (page.alive()) fill(holder, h("img", { class: "figure", src, alt: "the front as the server drew it", "data-testid": "front-png" })); })
    .catch((error) => fill(holder, problemBox(error)));
  return section("The front as the server draws it (PNG)", holder);
}

async function renderDone(view, cal, page) {
  const result = cal.result;
  const head = h("div", { class: "toolbar" }, badge(cal.status), deleteButton(cal.calibration_id));
  if (cal.status !== "succeeded" || !result) {
    const job = cal.job_id ? await get(`/jobs/${encodeURIComponent(cal.job_id)}`).catch(() => null) : null;
    const why = job && job.error ? job.error.detail || job.error.title : `the calibration's job ${cal.status}`;
    fill(view, h("h1", {}, `Calibration ${cal.calibration_id}`), head, section("Subject", subject(cal)), h("div", { class: "problem", "data-testid": "calibration-error" }, why));
    return;
  }
  fill(view, h("h1", {}, `Calibration ${cal.calibration_id}`), head,
    h("div", { class: "grid2" }, section("Subject", subject(cal)), recommendation(result)),
    frontSection(result), h("div", { class: "grid2" }, cost(result), heldOut(result)),
    result.attack_gate ? section("Attack gate", json(result.attack_gate)) : null,
    await frontPng(cal.calibration_id, page));
}

export async function calibrationDetail(view, { id }, _query, page) {
  const cal = await get(path(id));
  const render = (answer) => renderDone(view, answer, page);
  if (cal.status === "queued" || cal.status === "running") await followRunning(view, cal, page, render);
  else await render(cal);
}
