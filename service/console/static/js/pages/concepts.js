// Concepts: to be written (the console's pages follow jobs.js).
import { fill, h } from "../ui.js";

async function notYet(view) { fill(view, h("h1", {}, "Concepts"), h("p", { class: "muted" }, "This page is being built.")); }

export const routes = { concepts: notYet };
