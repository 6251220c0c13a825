// A calibration's front, interactive: any two metrics its candidates carry on x and y (each axis
// linear or log), each candidate a circle (feasible / infeasible apart), the recommendation starred,
// the Pareto front as a line; hover shows a candidate's options and scores, click selects it, and
// "Build this one" sends the documented unlearn request with its options (POST /models/{id}/unlearn).
import { request } from "../api.js";
import { actionButton, fill, fmtNum, h, kv, toast } from "../ui.js";
import { scatter } from "../plot.js";

const SPLIT_FIELDS = { nll_ratio: "nll_ratio", mean_nll: "mean_nll", exact_match: "exact_match" };
const LABELS = {
  retain_nll_ratio: "retain NLL ratio (variant / base): lower keeps more",
  forget_nll_ratio: "forget NLL ratio (variant / base): higher forgets more",
  retain_exact_match: "retain exact match: higher keeps more",
  forget_exact_match: "forget exact match: lower forgets more",
  alpha: "α (edit strength)",
};

/**
 * Every finite number a candidate carries, by name, as the server's front.png names them
 * (service.calibration.plot.candidate_values): <split>_<score>, the objective's metrics, and
 * <attack>.<metric> for the attack gate's; plus its α.
 */
export function candidateValues(c) {
  const values = { alpha: c.options.alpha };
  for (const split of ["forget", "retain"]) {
    for (const [field, suffix] of Object.entries(SPLIT_FIELDS)) values[`${split}_${suffix}`] = (c[split] || {})[field];
  }
  Object.assign(values, c.metrics || {});
  for (const [attack, scores] of Object.entries(c.attacked || {})) {
    for (const [metric, value] of Object.entries(scores || {})) values[`${attack}.${metric}`] = value;
  }
  return Object.fromEntries(Object.entries(values).filter(([, v]) => typeof v === "number" && Number.isFinite(v)));
}

/** The axes drawn first: as the server draws its PNG (exact match for the exact-match goal, else the NLL ratios). */
function defaultAxes(result, metrics) {
  if (metrics.includes("forget_accuracy")) return ["retain_accuracy", "forget_accuracy"];
  if (result.objective && result.objective.metric === "forget_exact_match") return ["retain_exact_match", "forget_exact_match"];
  return ["retain_nll_ratio", "forget_nll_ratio"];
}

function optionsText(o) {
  const parts = [`α ${fmtNum(o.alpha)}`, o.scaling, `module set ${o.module_set}`];
  if (o.layers) parts.push(`layers ${o.layers.join(",")}`);
  if (o.modules) parts.push(`modules ${o.modules.join(",")}`);
  if (o.module_strengths) parts.push(`strengths ${Object.entries(o.module_strengths).map(([k, v]) => `${k} ${fmtNum(v)}`).join(", ")}`);
  return parts.join(" · ");
}

export function tooltipText(c, values, recommended) {
  const flags = [c.feasible ? "feasible" : "infeasible", c.pareto ? "on the front" : null, recommended ? "★ recommended" : null, c.stage];
  const lines = [`candidate ${c.index} (${flags.filter(Boolean).join(", ")})`, optionsText(c.options)];
  for (const [name, value] of Object.entries(values).sort(([a], [b]) => a.localeCompare(b))) lines.push(`${name}: ${fmtNum(value, 4)}`);
  return lines.join("\n");
}

/** The unlearn request that builds a candidate: its options in the calibrated universe and the variant's format. */
export function buildRequest(result, candidate) {
  const o = candidate.options;
  const body = { concepts: result.concepts, alpha: o.alpha, scaling: o.scaling, universe: result.universe_id };
  if (o.modules) body.modules = o.modules;
  if (o.layers) body.layers = o.layers;
  if (o.module_strengths) body.module_strengths = o.module_strengths;
  body.format = result.recommended ? result.recommended.format : "checkpoint";
  return body;
}

function modelPath(modelId) { return modelId.split("/").map(encodeURIComponent).join("/"); }

function selectedPanel(result, c, values) {
  const build = actionButton("Build this one", "write", async () => {
    const answer = await request("POST", `/models/${modelPath(result.model_id)}/unlearn`, { json: buildRequest(result, c) });
    for (const warning of answer.data.warnings || []) toast(warning);
    window.location.hash = `#/variants/${encodeURIComponent(answer.data.variant.variant_id)}`;
  }, { testid: "build-candidate" });
  const recommended = result.recommended && result.recommended.candidate === c.index;
  const scores = Object.entries(values).sort(([a], [b]) => a.localeCompare(b)).map(([k, v]) => [k, fmtNum(v, 4)]);
  return h("div", { class: "cal-selected", "data-testid": "selected-candidate", "data-index": String(c.index) },
    h("h3", {}, `Candidate ${c.index}${recommended ? " ★ recommended" : ""}`),
    kv([["options", optionsText(c.options)], ["feasible", c.feasible ? "yes" : "no"], ["on the front", c.pareto ? "yes" : "no"], ["stage", c.stage],
      recommended ? ["variant", h("a", { href: `#/variants/${encodeURIComponent(result.recommended.variant_id)}` }, result.recommended.variant_id)] : null]),
    h("details", {}, h("summary", {}, `all ${scores.length} scores`), kv(scores)),
    h("div", { class: "toolbar" }, build,
      h("span", { class: "muted" }, `POST /models/${result.model_id}/unlearn with these options (format ${buildRequest(result, c).format})`)));
}

function axisSelect(name, metrics, value) {
  return h("select", { name, "data-testid": `plot-${name}` }, metrics.map((m) => h("option", { value: m, selected: m === value }, m)));
}

/** The front's section: axis pickers, log toggles, the plot, the legend and the selected candidate's panel. */
export function frontSection(result) {
  const values = new Map(result.candidates.map((c) => [c.index, candidateValues(c)]));
  const metrics = [...new Set([...values.values()].flatMap((v) => Object.keys(v)))].sort();
  const [x0, y0] = defaultAxes(result, metrics);
  const state = { x: metrics.includes(x0) ? x0 : metrics[0], y: metrics.includes(y0) ? y0 : metrics[1] || metrics[0], selected: null };
  state.logX = state.x.endsWith("_nll_ratio");
  state.logY = state.y.endsWith("_nll_ratio");
  const controls = { x: axisSelect("x", metrics, state.x), y: axisSelect("y", metrics, state.y),
    logX: h("input", { type: "checkbox", "data-testid": "plot-log-x", checked: state.logX }),
    logY: h("input", { type: "checkbox", "data-testid": "plot-log-y", checked: state.logY }) };
  const plotBox = h("div", {}), panel = h("div", { "data-testid": "selected-panel" }, h("p", { class: "muted" }, "Click a point to see the candidate and build it."));
  const recommended = result.recommended ? result.recommended.candidate : null;
  const byIndex = new Map(result.candidates.map((c) => [c.index, c]));
  const points = result.candidates.map((c) => ({ id: c.index, values: values.get(c.index), kind: c.feasible ? "feasible" : "infeasible", star: c.index === recommended }));
  const draw = () => {
    const plot = scatter(points, {
      x: state.x, y: state.y, logX: state.logX, logY: state.logY, xLabel: LABELS[state.x] || state.x, yLabel: LABELS[state.y] || state.y,
      line: result.pareto_front, selected: state.selected,
      tooltip: (p) => tooltipText(byIndex.get(p.id), p.values, p.id === recommended),
      onSelect: (p) => { state.selected = p.id; fill(panel, selectedPanel(result, byIndex.get(p.id), p.values)); },
    });
    const left = Number(plot.dataset.leftOut);
    fill(plotBox, plot, left ? h("p", { class: "muted", "data-testid": "plot-left-out" }, `${left} candidate(s) without a drawable value on these axes are not shown.`) : null);
  };
  for (const [key, input] of Object.entries(controls)) {
    input.addEventListener("change", () => { state[key] = input.type === "checkbox" ? input.checked : input.value; draw(); });
  }
  draw();
  const legend = h("p", { class: "cal-legend" }, h("span", { class: "dot feasible" }), " feasible ", h("span", { class: "dot infeasible" }), " infeasible ",
    h("span", { class: "star" }, "★"), " recommended ", h("span", { class: "line" }), " Pareto front");
  return h("section", { class: "card", "data-testid": "front" }, h("h2", {}, `Front: ${result.candidates.length} candidates`),
    h("div", { class: "toolbar" }, h("label", {}, "x", controls.x), h("label", { class: "inline" }, controls.logX, "log x"),
      h("label", {}, "y", controls.y), h("label", { class: "inline" }, controls.logY, "log y")),
    h("div", { class: "cal-front" }, plotBox, panel), legend);
}
