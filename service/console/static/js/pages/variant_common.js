// What the variant pages (list, detail, compare) show alike: a variant's terms and options, its
// provenance, its files' URLs, and an evaluation's figures. Evaluations come from the receipt
// (GET /variants/{id}/receipt: every stored evaluation, without per-probe records) or from an evaluate
// job's result: both have the EvaluationResult shape (api_schemas/evaluation.py), so one renderer serves.
import { download, get, request } from "../api.js";
import { actionButton, fmtBytes, fmtNum, fmtPct, fmtTime, h, table } from "../ui.js";

export const SPLITS = ["forget", "retain", "test"];

export function variantHref(id) { return `#/variants/${encodeURIComponent(id)}`; }

/** "forget −1, retain +0.5": each concept with its coefficient (an unlearn's target is −1). */
export function termsText(variant) {
  return Object.entries(variant.terms || {}).map(([name, c]) => `${name} ${c > 0 ? "+" : ""}${fmtNum(c)}`).join(", ");
}

/** α for an unlearn, else the compose's coefficients (α is null there). */
export function strengthText(variant) {
  return variant.alpha === null || variant.alpha === undefined ? termsText(variant) : `α ${fmtNum(variant.alpha)}`;
}

export function labelsText(labels) {
  return Object.entries(labels || {}).map(([k, v]) => `${k}:${v}`).join(", ");
}

/** The options a build was asked for, as [label, raw value] (raw: the compare page diffs them). */
export function optionRows(variant) {
  return [
    ["terms", variant.terms], ["alpha", variant.alpha], ["scaling", variant.scaling], ["format", variant.format],
    ["lora rank", variant.lora_rank], ["lora target", variant.lora_target], ["gguf quantization", variant.gguf_quantization],
    ["modules", variant.modules], ["layers", variant.layers], ["module strengths", variant.module_strengths],
    ["rcond", variant.rcond], ["reference", variant.reference], ["universe", variant.universe_id],
    ["unreached layers", variant.unreached_layers && variant.unreached_layers.length ? variant.unreached_layers : null],
  ];
}

/** Who made it, when and why: [label, raw value]. */
export function provenanceRows(variant) {
  return [
    ["labels", variant.labels && Object.keys(variant.labels).length ? variant.labels : null],
    ["reason", variant.reason], ["created", variant.created_at], ["created by (key)", variant.created_by],
    ["reverts", variant.reverts],
  ];
}

/** A raw option or provenance value as text ("—" for none). */
export function showValue(label, value) {
  if (value === null || value === undefined) return "—";
  if (label === "created") return fmtTime(value);
  if (label === "terms") return Object.entries(value).map(([k, c]) => `${k} ${fmtNum(c)}`).join(", ");
  if (label === "labels" || label === "module strengths") return Object.entries(value).map(([k, v]) => `${k}:${v}`).join(", ");
  if (Array.isArray(value)) return value.join(", ");
  return typeof value === "number" ? fmtNum(value) : String(value);
}

export function filePath(variantId, path) {
  return `/variants/${encodeURIComponent(variantId)}/files/${path.split("/").map(encodeURIComponent).join("/")}`;
}

export function downloadFile(variantId, path) { return download(filePath(variantId, path), path.split("/").pop()); }

/** Save `value` as a JSON file without another request (the receipt the page already holds). */
export function downloadJson(value, filename) {
  const href = URL.createObjectURL(new Blob([JSON.stringify(value, null, 2)], { type: "application/json" }));
  const anchor = h("a", { href, download: filename });
  document.body.append(anchor);
  anchor.click();
  anchor.remove();
  setTimeout(() => URL.revokeObjectURL(href), 60_000);
}

/** The receipt of a ready variant, or null with why (a building or failed variant answers 409). */
export async function receiptOf(variant) {
  if (variant.status !== "ready") return { receipt: null, why: `no receipt while the variant is ${variant.status}` };
  try {
    return { receipt: await get(`/variants/${encodeURIComponent(variant.variant_id)}/receipt`), why: null };
  } catch (error) {
    if (error.status === 409) return { receipt: null, why: error.message };
    throw error;
  }
}

export async function modelCard(variantId) {
  return (await request("GET", `/variants/${encodeURIComponent(variantId)}/model-card`, { as: "text" })).data;
}

// ---------------------------------------------------------------- evaluations

/** A number cell carrying its raw value and where in the result it came from (tests compare both). */
function cell(value, metric, format = fmtNum) {
  return h("span", { "data-metric": metric, "data-value": value === null || value === undefined ? "" : String(value) }, format(value));
}

function ratio(variantNll, baseNll, metric) {
  const value = typeof variantNll === "number" && typeof baseNll === "number" && baseNll > 0 ? variantNll / baseNll : null;
  return h("span", { "data-ratio": metric, "data-value": value === null ? "" : String(value) }, value === null ? "—" : `×${fmtNum(value, 2)}`);
}

/** Per set: exact match and answer NLL of the base and the variant, and the NLL ratio. */
export function summaryTable(evaluation, prefix = "summary") {
  const summary = evaluation.summary || {};
  const splits = SPLITS.filter((s) => (summary.variant || {})[s] || (summary.base || {})[s]);
  const at = (model, split) => ((summary[model] || {})[split] || {});
  return table([
    { label: "set", value: (s) => `${s} (${at("variant", s).n ?? at("base", s).n ?? "?"})` },
    { label: "base exact match", num: true, value: (s) => cell(at("base", s).exact_match, `${prefix}.base.${s}.exact_match`, fmtPct) },
    { label: "variant exact match", num: true, value: (s) => cell(at("variant", s).exact_match, `${prefix}.variant.${s}.exact_match`, fmtPct) },
    { label: "base NLL", num: true, value: (s) => cell(at("base", s).mean_nll, `${prefix}.base.${s}.mean_nll`) },
    { label: "variant NLL", num: true, value: (s) => cell(at("variant", s).mean_nll, `${prefix}.variant.${s}.mean_nll`) },
    { label: "NLL ratio", num: true, value: (s) => ratio(at("variant", s).mean_nll, at("base", s).mean_nll, `${prefix}.${s}`) },
  ], splits, { testid: "eval-summary", rowId: (s) => s, empty: "No probes scored." });
}

/** One row per attack and set: the attacked variant and base, whether the attack's thresholds held. */
export function attackTable(evaluation) {
  const rows = [];
  for (const [name, report] of Object.entries(evaluation.attacks || {})) {
    for (const split of SPLITS) if ((report.summary.variant || {})[split]) rows.push({ name, report, split });
  }
  const at = (r, model) => ((r.report.summary[model] || {})[r.split] || {});
  const metric = (r, model, field) => `attacks.${r.name}.summary.${model}.${r.split}.${field}`;
  return table([
    { label: "attack", value: (r) => r.name },
    { label: "passed", value: (r) => passedBadge(r.report.passed, r.name) },
    { label: "set", value: (r) => `${r.split} (${at(r, "variant").n})` },
    { label: "variant exact match", num: true, value: (r) => cell(at(r, "variant").exact_match, metric(r, "variant", "exact_match"), fmtPct) },
    { label: "base exact match", num: true, value: (r) => cell(at(r, "base").exact_match, metric(r, "base", "exact_match"), fmtPct) },
    { label: "variant NLL", num: true, value: (r) => cell(at(r, "variant").mean_nll, metric(r, "variant", "mean_nll")) },
    { label: "base NLL", num: true, value: (r) => cell(at(r, "base").mean_nll, metric(r, "base", "mean_nll")) },
    { label: "NLL ratio", num: true, value: (r) => ratio(at(r, "variant").mean_nll, at(r, "base").mean_nll, `attacks.${r.name}.${r.split}`) },
    { label: "recovered", num: true, value: (r) => (r.split === "forget" && r.report.recovered_fraction !== undefined
      ? cell(r.report.recovered_fraction, `attacks.${r.name}.recovered_fraction`, fmtPct) : "") },
  ], rows, { testid: "eval-attacks", rowId: (r) => `${r.name}/${r.split}` });
}

function passedBadge(passed, name) {
  if (passed === undefined || passed === null) return h("span", { class: "muted", "data-passed": "", title: "no thresholds were set" }, "no bound");
  return h("span", { class: `badge ${passed ? "ok" : "failed"}`, "data-passed": String(passed), "data-attack": name }, passed ? "passed" : "failed");
}

/**
 * What lines evaluations up (the compare page's rows): each probe set's digest and size
 * ("forget 40 #1a2b3c4d5e6f / retain 40 #…": the same probes give the same text, whoever scored them),
 * or, for an evaluation stored before its probe sets were recorded, the sets' sizes alone.
 */
export function evaluationSignature(evaluation) {
  const sets = evaluation.probe_sets;
  if (sets && Object.keys(sets).length) {
    const names = [...SPLITS.filter((s) => sets[s]), ...Object.keys(sets).filter((s) => !SPLITS.includes(s))];
    return names.map((name) => `${name} ${sets[name].n} #${sets[name].sha256.slice(0, 12)}`).join(" / ") + " probes";
  }
  const sizes = SPLITS.map((s) => (((evaluation.summary || {}).variant || {})[s] || {}).n).map((n, i) => (n ? `${SPLITS[i]} ${n}` : null));
  return sizes.filter(Boolean).join(" / ") + " probes";
}

/** When, by whom and why an evaluation was asked for (an evaluation stored before this was recorded says so). */
export function evaluationProvenance(evaluation) {
  if (!evaluation.created_at) {
    return h("p", { class: "muted", "data-testid": "evaluation-provenance", "data-recorded": "false" },
      "stored before who, when and which probes were recorded (lined up by set sizes)");
  }
  const labels = labelsText(evaluation.labels);
  return h("p", {
    class: "muted", "data-testid": "evaluation-provenance", "data-recorded": "true",
    "data-created-at": evaluation.created_at, "data-created-by": evaluation.created_by || "", "data-reason": evaluation.reason || "",
  },
  `requested ${fmtTime(evaluation.created_at)} by `, h("code", {}, evaluation.created_by || "—"),
  evaluation.reason ? ` · reason: ${evaluation.reason}` : "", labels ? ` · labels: ${labels}` : "",
  ` · probes: ${evaluationSignature(evaluation)}`);
}

/** One evaluation's figures: its summary, its attacks (when any ran), TOFU's values (when asked). */
export function evaluationBlock(evaluation, title) {
  const attacks = Object.keys(evaluation.attacks || {});
  const passed = attacks.filter((a) => evaluation.attacks[a].passed === true);
  return h("div", { class: "evaluation", "data-testid": "evaluation", "data-evaluation": evaluation.evaluation_id || "" },
    h("h3", {}, title || `Evaluation on ${evaluationSignature(evaluation)}`),
    evaluationProvenance(evaluation),
    summaryTable(evaluation),
    attacks.length ? [
      h("p", { class: "muted", "data-testid": "attacks-passed" }, `attacks: ${attacks.join(", ")}; passed: ${passed.length ? passed.join(", ") : "none"}`),
      attackTable(evaluation),
    ] : null,
    evaluation.tofu && evaluation.tofu.variant ? h("details", {}, h("summary", {}, "TOFU metrics (variant)"),
      table([{ label: "metric", value: (e) => e[0] }, { label: "value", num: true, value: (e) => fmtNum(e[1]) }],
        Object.entries(evaluation.tofu.variant.values || {}))) : null);
}

/** Files with their size, digest and a Download button each. */
export function filesTable(variant) {
  return table([
    { label: "file", value: (f) => h("code", {}, f.path) },
    { label: "size", num: true, value: (f) => fmtBytes(f.size) },
    { label: "sha256", value: (f) => h("code", { title: f.sha256 }, `${f.sha256.slice(0, 16)}…`) },
    { label: "", value: (f) => downloadButton(variant.variant_id, f.path) },
  ], variant.files || [], { testid: "variant-files", rowId: (f) => f.path, empty: "No files (not ready)." });
}

/** Download one file (any key may read): a failure is a toast naming the service's problem. */
export function downloadButton(variantId, path, label = "Download") {
  const button = actionButton(label, "read", () => downloadFile(variantId, path), { kind: "secondary", testid: "download-file" });
  button.dataset.path = path;
  return button;
}
