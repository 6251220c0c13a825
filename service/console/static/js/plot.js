// An SVG scatter plot with no library: linear or log axes, one circle per point, a line through some
// points (a Pareto front), a star on one, a tooltip on hover and a selection on click. Styles live in
// CSS classes (calibrations.css): the Content-Security-Policy forbids inline style attributes, and
// the tooltip is placed through element.style, which it allows.
import { h } from "./ui.js";

const SVG = "http://www.w3.org/2000/svg";
const SIZE = { width: 760, height: 440, left: 70, right: 20, top: 16, bottom: 52 };

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value !== null && value !== undefined && value !== false) node.setAttribute(name, String(value));
  }
  children.flat().forEach((child) => child && node.append(child));
  return node;
}

/** A value drawable on an axis: finite, and positive on a log axis. */
function drawable(value, log) {
  return typeof value === "number" && Number.isFinite(value) && (!log || value > 0);
}

/** Tick values between lo and hi: 1-2-5 steps (linear) or 1-2-5 per decade (log). */
export function ticks(lo, hi, log) {
  if (log) {
    const found = [];
    for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e += 1) {
      for (const m of [1, 2, 5]) {
        const t = m * 10 ** e;
        if (t >= lo * 0.999 && t <= hi * 1.001) found.push(t);
      }
    }
    // A span under a decade may hold one 1-2-5 tick or none: fall back to linear steps, placed on the log scale.
    return found.length >= 3 ? found : ticks(lo, hi, false).filter((t) => t > 0);
  }
  const span = hi - lo || Math.abs(hi) || 1;
  const raw = span / 5;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(Number(t.toPrecision(12)));
  return out;
}

/** A data -> pixel mapping of [lo, hi] onto [a, b], padded so that no point sits on the frame. */
export function axisScale(values, log, a, b) {
  let lo = Math.min(...values), hi = Math.max(...values);
  if (log) {
    const pad = lo === hi ? 2 : (hi / lo) ** 0.05;
    lo /= pad; hi *= pad;
    const f = (v) => (Math.log(v) - Math.log(lo)) / (Math.log(hi) - Math.log(lo));
    return { lo, hi, log, place: (v) => a + f(v) * (b - a) };
  }
  const pad = lo === hi ? Math.abs(lo) * 0.1 || 1 : (hi - lo) * 0.05;
  lo -= pad; hi += pad;
  return { lo, hi, log, place: (v) => a + ((v - lo) / (hi - lo)) * (b - a) };
}

function tickLabel(t) {
  const m = Math.abs(t);
  return m !== 0 && (m < 1e-3 || m >= 1e5) ? t.toExponential(0) : String(Number(t.toPrecision(4)));
}

function axes(sx, sy, xLabel, yLabel) {
  const { width, height, left, right, top, bottom } = SIZE;
  const nodes = [svg("rect", { class: "plot-frame", x: left, y: top, width: width - left - right, height: height - top - bottom })];
  for (const t of ticks(sx.lo, sx.hi, sx.log)) {
    const x = sx.place(t);
    nodes.push(svg("line", { class: "plot-grid", x1: x, x2: x, y1: top, y2: height - bottom }));
    nodes.push(svg("text", { x, y: height - bottom + 16, "text-anchor": "middle" }, tickLabel(t)));
  }
  for (const t of ticks(sy.lo, sy.hi, sy.log)) {
    const y = sy.place(t);
    nodes.push(svg("line", { class: "plot-grid", x1: left, x2: width - right, y1: y, y2: y }));
    nodes.push(svg("text", { x: left - 6, y: y + 4, "text-anchor": "end" }, tickLabel(t)));
  }
  nodes.push(svg("text", { class: "plot-label", "data-testid": "plot-x-label", x: (left + width - right) / 2, y: height - 12, "text-anchor": "middle" }, xLabel));
  const yMid = (top + height - bottom) / 2;
  nodes.push(svg("text", { class: "plot-label", "data-testid": "plot-y-label", x: 16, y: yMid, "text-anchor": "middle", transform: `rotate(-90 16 ${yMid})` }, yLabel));
  return nodes;
}

function starPath(cx, cy, r) {
  const points = [];
  for (let i = 0; i < 10; i += 1) {
    const angle = -Math.PI / 2 + (i * Math.PI) / 5;
    const radius = i % 2 ? r * 0.45 : r;
    points.push(`${(cx + radius * Math.cos(angle)).toFixed(1)},${(cy + radius * Math.sin(angle)).toFixed(1)}`);
  }
  return `M${points.join("L")}Z`;
}

function showTip(tip, wrap, event, text) {
  tip.textContent = text;
  tip.hidden = false;
  const box = wrap.getBoundingClientRect();
  const x = event.clientX - box.left + 14, y = event.clientY - box.top + 14;
  tip.style.left = `${Math.min(x, box.width - 260)}px`;
  tip.style.top = `${y}px`;
}

/**
 * The plot. points: [{id, values: {metric: number}, kind: "feasible"|"infeasible", star?: bool}];
 * opts: {x, y, logX, logY, xLabel?, yLabel?, line?: [ids, in any order; drawn by increasing x],
 * tooltip(point) -> string, onSelect(point), selected?: id}. Points without a drawable value on
 * either axis are left out; the returned element says how many (data-left-out).
 */
export function scatter(points, opts) {
  const { width, height, left, right, top, bottom } = SIZE;
  const shown = points.filter((p) => drawable(p.values[opts.x], opts.logX) && drawable(p.values[opts.y], opts.logY));
  const wrap = h("div", { class: "plot-wrap", "data-testid": "plot", "data-left-out": String(points.length - shown.length) });
  const tip = h("div", { class: "plot-tip", "data-testid": "plot-tooltip", hidden: true });
  if (!shown.length) {
    wrap.append(h("p", { class: "muted" }, `No candidate has a drawable ${opts.x} and ${opts.y}${opts.logX || opts.logY ? " on a log axis" : ""}.`));
    return wrap;
  }
  const sx = axisScale(shown.map((p) => p.values[opts.x]), opts.logX, left, width - right);
  const sy = axisScale(shown.map((p) => p.values[opts.y]), opts.logY, height - bottom, top);
  const root = svg("svg", { class: "plot", viewBox: `0 0 ${width} ${height}`, width, height, role: "img", "aria-label": `${opts.y} against ${opts.x}` });
  root.append(...axes(sx, sy, opts.xLabel || opts.x, opts.yLabel || opts.y));
  const onLine = new Set(opts.line || []);
  const front = shown.filter((p) => onLine.has(p.id)).sort((a, b) => a.values[opts.x] - b.values[opts.x]);
  if (front.length > 1) {
    const path = front.map((p) => `${sx.place(p.values[opts.x]).toFixed(1)},${sy.place(p.values[opts.y]).toFixed(1)}`).join(" ");
    root.append(svg("polyline", { class: "plot-front", "data-testid": "plot-front", points: path }));
  }
  for (const p of shown) root.append(pointNode(p, sx, sy, opts, { wrap, tip, root }));
  for (const p of shown.filter((q) => q.star)) {
    root.append(svg("path", { class: "plot-star", "data-testid": "plot-recommended", d: starPath(sx.place(p.values[opts.x]), sy.place(p.values[opts.y]), 11) }));
  }
  wrap.append(root, tip);
  return wrap;
}

function pointNode(p, sx, sy, opts, { wrap, tip, root }) {
  const classes = ["plot-point", p.kind, p.id === opts.selected ? "selected" : null].filter(Boolean).join(" ");
  const node = svg("circle", {
    class: classes, "data-testid": "plot-point", "data-id": p.id, "data-kind": p.kind, tabindex: 0,
    cx: sx.place(p.values[opts.x]).toFixed(1), cy: sy.place(p.values[opts.y]).toFixed(1), r: 6,
  });
  node.addEventListener("mouseenter", (event) => showTip(tip, wrap, event, opts.tooltip(p)));
  node.addEventListener("mousemove", (event) => showTip(tip, wrap, event, opts.tooltip(p)));
  node.addEventListener("mouseleave", () => { tip.hidden = true; });
  const select = () => {
    root.querySelectorAll(".plot-point.selected").forEach((n) => n.classList.remove("selected"));
    node.classList.add("selected");
    opts.onSelect(p);
  };
  node.addEventListener("click", select);
  node.addEventListener("keydown", (event) => { if (event.key === "Enter" || event.key === " ") select(); });
  return node;
}
