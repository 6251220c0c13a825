// #/compare?ids=a,b,c: variants side by side, one column each: options, concepts, α, provenance,
// evaluation summaries (stored evaluations from each receipt), the receipt's digest and a download.
// A row whose values differ between the variants is highlighted.
//
// Evaluations of different variants are lined up by their probe sets' digests and sizes
// (variant_common.evaluationSignature; receipt evaluations' probe_sets): the same probe files give the
// same row, whoever scored them and when. An evaluation stored before probe sets were recorded is
// lined up by its sets' sizes alone (a row of its own).
import { get } from "../api.js";
import { badge, fill, fmtNum, fmtPct, h, problemBox } from "../ui.js";
import {
  SPLITS, downloadButton, downloadJson, evaluationSignature, optionRows, provenanceRows, receiptOf, showValue, variantHref,
} from "./variant_common.js";

async function loadOne(id) {
  try {
    const variant = await get(`/variants/${encodeURIComponent(id)}`);
    return { id, variant, ...(await receiptOf(variant)) };
  } catch (error) {
    return { id, error };
  }
}

/** label -> raw value per evaluation figure of one variant, keyed so that variants line up. */
function evaluationFigures(receipt) {
  const figures = new Map();
  const put = (key, value) => figures.set(key, figures.has(key) ? `${figures.get(key)} / ${value}` : value);
  for (const evaluation of (receipt && receipt.receipt.evaluations) || []) {
    const sig = evaluationSignature(evaluation);
    const variant = (evaluation.summary || {}).variant || {};
    const base = (evaluation.summary || {}).base || {};
    for (const split of SPLITS) {
      if (!variant[split]) continue;
      put(`${sig} · ${split} exact match`, fmtPct(variant[split].exact_match));
      put(`${sig} · ${split} NLL ratio`, base[split] && base[split].mean_nll > 0 ? `×${fmtNum(variant[split].mean_nll / base[split].mean_nll, 2)}` : "—");
    }
    for (const [name, report] of Object.entries(evaluation.attacks || {})) {
      for (const split of SPLITS) {
        const attacked = (report.summary.variant || {})[split];
        if (attacked) put(`${sig} · ${name} · ${split} exact match (attacked)`, fmtPct(attacked.exact_match));
      }
      if (report.passed !== undefined && report.passed !== null) put(`${sig} · ${name} · passed`, report.passed ? "passed" : "failed");
    }
  }
  return figures;
}

/** The rows: [section, label, per column a node or text, per column the value compared]. */
function rows(columns) {
  const ok = columns.filter((c) => c.variant);
  const out = [];
  const add = (group, label, pick, show = (v) => showValue(label, v)) => out.push({
    group, label, cells: columns.map((c) => (c.variant ? show(pick(c), c) : "—")), values: columns.map((c) => (c.variant ? JSON.stringify(pick(c) ?? null) : null)),
  });
  add("variant", "status", (c) => c.variant.status, (v) => badge(v));
  add("variant", "model", (c) => c.variant.model_id);
  add("variant", "concepts", (c) => Object.keys(c.variant.terms || {}).sort(), (v) => v.join(", "));
  optionRows(ok[0] ? ok[0].variant : {}).forEach(([label], i) => add("options", label, (c) => optionRows(c.variant)[i][1]));
  provenanceRows(ok[0] ? ok[0].variant : {}).forEach(([label], i) => add("provenance", label, (c) => provenanceRows(c.variant)[i][1]));
  const figures = columns.map((c) => evaluationFigures(c.receipt));
  const keys = [...new Set(figures.flatMap((f) => [...f.keys()]))]; // first seen first: a set's figures stay together
  keys.forEach((key) => add("evaluations", key, (c) => figures[columns.indexOf(c)].get(key) ?? null, (v) => v ?? "—"));
  if (!keys.length) add("evaluations", "stored evaluations", () => null, () => "none");
  add("receipt", "receipt digest", (c) => (c.receipt ? c.receipt.digest : null), (v, c) => h("code", { title: v || c.why || "" }, v ? `${v.slice(0, 16)}…` : "—"));
  add("receipt", "signed", (c) => (c.receipt ? c.receipt.signed : null), (v) => (v === null ? "—" : v ? "yes" : "no"));
  // An option or provenance field no variant has (lora rank on checkpoints) is noise here.
  return out.filter((row) => !["options", "provenance"].includes(row.group) || row.values.some((v) => v !== null && v !== "null"));
}

function differs(values) {
  const present = values.filter((v) => v !== null);
  return present.length > 1 && new Set(present).size > 1;
}

function downloads(column) {
  if (!column.variant || !column.variant.files.length) return "—";
  // The largest file is the weights: the one a reviewer downloads.
  const main = [...column.variant.files].sort((a, b) => b.size - a.size)[0];
  return h("div", { class: "downloads" }, downloadButton(column.id, main.path, `Download ${main.path}`),
    column.receipt ? h("button", { type: "button", class: "secondary", onclick: () => downloadJson(column.receipt, `receipt-${column.id}.json`) }, "Receipt JSON") : null);
}

function compareTable(columns) {
  const head = h("tr", {}, h("th", {}, ""), columns.map((c) => h("th", { "data-variant": c.id },
    h("a", { href: variantHref(c.id), class: "mono" }, c.id), c.error ? problemBox(c.error) : null)));
  const body = [];
  let group = null;
  for (const row of rows(columns)) {
    if (row.group !== group) { group = row.group; body.push(h("tr", { class: "group" }, h("th", { colspan: String(columns.length + 1) }, group))); }
    const changed = differs(row.values);
    body.push(h("tr", { class: changed ? "differs" : null, "data-row": row.label, "data-differs": String(changed) },
      h("th", { scope: "row" }, row.label), row.cells.map((cell, i) => h("td", { "data-variant": columns[i].id }, cell))));
  }
  body.push(h("tr", { "data-row": "download" }, h("th", { scope: "row" }, "download"), columns.map((c) => h("td", { "data-variant": c.id }, downloads(c)))));
  return h("table", { class: "compare", "data-testid": "compare-table" }, h("thead", {}, head), h("tbody", {}, body));
}

export async function compareRoute(view, _params, query) {
  const ids = [...new Set((query.ids || "").split(",").map((s) => s.trim()).filter(Boolean))];
  fill(view, h("h1", {}, "Compare variants"));
  if (ids.length < 2) {
    view.append(h("p", { class: "problem", "data-testid": "problem" }, "Choose two or more variants to compare: tick them in the variants list (#/compare?ids=a,b)."));
    return;
  }
  const columns = await Promise.all(ids.map(loadOne));
  view.append(h("p", { class: "muted" }, "Highlighted rows differ between the variants."), h("div", { class: "card scroll" }, compareTable(columns)));
}
