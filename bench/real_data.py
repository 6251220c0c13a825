"""The real-model bench's data: three kinds of facts SmolLM2-135M-Instruct knows, and general text.

* **capitals** ("The capital of France is" → " Paris"): the kind the edit forgets. Part of them is
  the target concept's data ("in data"), the rest is held out: facts of the same kind no concept,
  search or training loop ever saw.
* **symbols** ("The chemical symbol of gold is" → " Au"): a kind to keep, in the universe as a
  reference concept (in data) and held out.
* **opposites** ("The opposite of hot is" → " cold"): a kind to keep that no concept names: what an
  edit does to knowledge the universe knows nothing about.
* **general text**: paragraphs the model writes itself from everyday openers (temperature 0.8, seed
  fixed), as issue 36 suggests for a platform without a retain corpus: part of them is a reference
  concept, a few are the calibration's ``utility.general`` set, the rest is held out for perplexity.

Every fact is kept only if the base model answers it exactly (teacher-forced argmax over the answer
tokens, which is what greedy decoding of as many tokens gives): a fact it does not know cannot be
forgotten. Splits are drawn with fixed seeds, so a run is reproducible on one machine.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from service.engine.evaluate import TextProbe as Probe
from service.engine.evaluate import encode_probe

Record = dict[str, str]

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo", "Greece": "Athens",
    "Austria": "Vienna", "Poland": "Warsaw", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Denmark": "Copenhagen", "Ireland": "Dublin", "Hungary": "Budapest", "Belgium": "Brussels",
    "Netherlands": "Amsterdam", "Canada": "Ottawa", "Mexico": "Mexico City", "Argentina": "Buenos Aires",
    "Peru": "Lima", "Chile": "Santiago", "Colombia": "Bogota", "Cuba": "Havana", "Kenya": "Nairobi",
    "Thailand": "Bangkok", "Vietnam": "Hanoi", "South Korea": "Seoul", "Czech Republic": "Prague",
    "Romania": "Bucharest", "Bulgaria": "Sofia", "Indonesia": "Jakarta", "Philippines": "Manila",
    "Pakistan": "Islamabad", "Israel": "Jerusalem", "Ethiopia": "Addis Ababa", "Scotland": "Edinburgh",
    "England": "London", "Wales": "Cardiff", "Iceland": "Reykjavik", "Malaysia": "Kuala Lumpur",
    "Turkey": "Ankara", "Iran": "Tehran", "Iraq": "Baghdad", "India": "New Delhi", "Brazil": "Brasilia",
    "Australia": "Canberra", "Venezuela": "Caracas", "Ukraine": "Kyiv", "Switzerland": "Bern",
}  # fmt: skip
SYMBOLS = {
    "gold": "Au", "silver": "Ag", "iron": "Fe", "copper": "Cu", "sodium": "Na", "potassium": "K", "lead": "Pb",
    "tin": "Sn", "mercury": "Hg", "oxygen": "O", "hydrogen": "H", "nitrogen": "N", "calcium": "Ca",
    "chlorine": "Cl", "zinc": "Zn", "sulfur": "S", "uranium": "U", "silicon": "Si", "tungsten": "W",
    "phosphorus": "P", "fluorine": "F", "lithium": "Li", "nickel": "Ni", "carbon": "C", "helium": "He",
    "magnesium": "Mg", "aluminium": "Al", "neon": "Ne", "argon": "Ar", "platinum": "Pt", "cobalt": "Co",
}  # fmt: skip
OPPOSITES = {
    "hot": "cold", "up": "down", "big": "small", "day": "night", "black": "white", "left": "right",
    "fast": "slow", "happy": "sad", "open": "closed", "light": "dark", "wet": "dry", "hard": "soft",
    "high": "low", "strong": "weak", "early": "late", "rich": "poor", "full": "empty", "love": "hate",
    "good": "bad", "top": "bottom", "north": "south", "east": "west", "win": "lose", "push": "pull",
    "true": "false", "thick": "thin", "inside": "outside", "old": "new", "first": "last", "asleep": "awake",
}  # fmt: skip
# More of each fact kind, for the acceptance test of issue 36 (tests/e2e/test_real_llm_calibration.py),
# which needs enough facts the model knows with confidence to hold three sets of each out; the bench's
# own lists above stay as they are (its tables and the README's figures are measured on them).
MORE_CAPITALS = {
    "Nigeria": "Abuja", "Ghana": "Accra", "Morocco": "Rabat", "Algeria": "Algiers", "Tunisia": "Tunis",
    "Saudi Arabia": "Riyadh", "Syria": "Damascus", "Lebanon": "Beirut", "Jordan": "Amman", "Afghanistan": "Kabul",
    "Nepal": "Kathmandu", "Bangladesh": "Dhaka", "Sri Lanka": "Colombo", "Mongolia": "Ulaanbaatar",
    "Serbia": "Belgrade", "Croatia": "Zagreb", "Slovakia": "Bratislava", "Slovenia": "Ljubljana",
    "Estonia": "Tallinn", "Latvia": "Riga", "Lithuania": "Vilnius", "Belarus": "Minsk", "New Zealand": "Wellington",
    "Uruguay": "Montevideo", "Paraguay": "Asuncion", "Bolivia": "La Paz", "Ecuador": "Quito", "Jamaica": "Kingston",
    "Qatar": "Doha", "Uganda": "Kampala", "Zimbabwe": "Harare", "Senegal": "Dakar", "Sudan": "Khartoum",
    "Libya": "Tripoli", "Cyprus": "Nicosia", "Albania": "Tirana", "Armenia": "Yerevan", "Georgia": "Tbilisi",
    "Taiwan": "Taipei", "North Korea": "Pyongyang", "Singapore": "Singapore", "Luxembourg": "Luxembourg",
    "Monaco": "Monaco",
}  # fmt: skip
MORE_SYMBOLS = {
    "bromine": "Br", "iodine": "I", "manganese": "Mn", "chromium": "Cr", "titanium": "Ti", "boron": "B",
    "barium": "Ba", "radium": "Ra", "plutonium": "Pu", "krypton": "Kr", "xenon": "Xe", "radon": "Rn",
    "arsenic": "As", "bismuth": "Bi", "antimony": "Sb", "cadmium": "Cd", "selenium": "Se", "beryllium": "Be",
    "gallium": "Ga", "germanium": "Ge", "strontium": "Sr", "cesium": "Cs", "thorium": "Th", "vanadium": "V",
    "osmium": "Os", "iridium": "Ir", "palladium": "Pd", "rhodium": "Rh", "scandium": "Sc", "zirconium": "Zr",
    "molybdenum": "Mo", "ruthenium": "Ru", "indium": "In", "tellurium": "Te", "tantalum": "Ta", "polonium": "Po",
    "neptunium": "Np", "francium": "Fr", "rubidium": "Rb", "americium": "Am", "curium": "Cm",
    "einsteinium": "Es", "europium": "Eu",
}  # fmt: skip
OPENERS = [
    "Yesterday I walked to the market and", "The best way to learn a new language is", "In the morning, the garden",
    "My grandmother always said that", "When the train finally arrived,", "Cooking rice properly requires",
    "The old library on the corner", "Most people enjoy the summer because", "A good friend is someone who",
    "The children played in the park until", "Writing a clear letter starts with", "During the storm last night,",
    "The village sits at the foot of", "Learning to ride a bicycle", "Our teacher explained that the moon",
    "The small café near the station", "Every winter, the family", "A healthy breakfast usually includes",
    "The museum opened a new exhibition about", "When you plant tomatoes,",
]  # fmt: skip


@dataclass(frozen=True)
class Sizes:
    """How the known facts and the paragraphs are split (shares of what the base model knows)."""

    forget_in_data: float = 0.7  # of the known capitals: the target concept; the rest held out
    kept_in_data: float = 0.55  # of the known symbols: the reference concept; the rest held out
    per_opener: int = 5  # paragraphs per opener (20 openers)
    reference_share: float = 0.7  # of the paragraphs: the general-text reference concept
    utility_share: float = 0.1  # of the paragraphs: the calibration's utility.general set
    max_new_tokens: int = 40  # a paragraph's length in tokens after its opener


@dataclass(frozen=True)
class BenchData:
    """Every probe set and concept of one run (records as the API takes them)."""

    forget: list[Record]  # the target concept's facts ("in data")
    held_forget: list[Record]  # the same kind, in no concept
    kept: list[Record]  # the kept kind's reference concept
    held_kept: list[Record]  # the kept kind, in no concept
    unseen: list[Record]  # a third kind no concept names
    reference_text: list[Record]  # the general-text reference concept
    general: list[Record]  # the calibration's utility.general set
    held_general: list[Record]  # general text for perplexity, in no concept
    notes: dict[str, Any] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        names = ("forget", "held_forget", "kept", "held_kept", "unseen", "reference_text", "general", "held_general")
        return {name: len(getattr(self, name)) for name in names}


def fact_records(facts: dict[str, str], template: str) -> list[Record]:
    return [{"prompt": template.format(key), "completion": f" {value}"} for key, value in facts.items()]


def known(model: Any, tokenizer: Any, records: Sequence[Record]) -> list[Record]:
    """The records whose answer the model's teacher-forced argmax reproduces token for token (tokenized
    as the service tokenizes a probe: :func:`service.engine.evaluate.encode_probe`)."""
    kept = []
    for record in records:
        prompt, answer = encode_probe(tokenizer, Probe(record["prompt"], record["completion"]))
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + answer])).logits[0]
        if answer and logits[len(prompt) - 1 : -1].argmax(-1).tolist() == answer:
            kept.append(record)
    return kept


def confidently_known(model: Any, tokenizer: Any, records: Sequence[Record], min_probability: float = 0.5) -> list[Record]:
    """The records :func:`known` keeps whose answer tokens the model also gives at least
    ``min_probability`` each on average (the geometric mean of their teacher-forced probabilities:
    ``exp(-mean NLL)``, the per-token measure perplexity is; a long answer is not penalised for its length).

    A fact the model answers by a hair (tellurium's " Te" at 9% on SmolLM2, ahead of every other
    token but far from sure) flips under any change to the weights, an edit of another kind of fact
    or a quantization alike: as a kept fact it measures that noise, not the edit.
    """
    kept = []
    for record in known(model, tokenizer, records):
        prompt, answer = encode_probe(tokenizer, Probe(record["prompt"], record["completion"]))
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
        log_p = torch.log_softmax(logits.double(), dim=-1).gather(1, torch.tensor(answer).unsqueeze(1)).mean()
        if float(log_p) >= math.log(min_probability):
            kept.append(record)
    return kept


def model_paragraphs(model: Any, tokenizer: Any, sizes: Sizes, seed: int = 0) -> list[Record]:
    """Paragraphs the model writes from :data:`OPENERS`, as probes (the first word, then the rest), shuffled."""
    torch.manual_seed(seed)
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    prompts = [opener for opener in OPENERS for _ in range(sizes.per_opener)]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = model.generate(
            **batch,
            max_new_tokens=sizes.max_new_tokens,
            do_sample=True,
            temperature=0.8,
            top_p=0.95,
            pad_token_id=tokenizer.eos_token_id,
        )
    tokenizer.padding_side = side
    paragraphs = []
    for text in tokenizer.batch_decode(out, skip_special_tokens=True):
        first, _, rest = " ".join(text.split()).partition(" ")
        paragraphs.append({"prompt": first, "completion": " " + rest})
    return random.Random(seed + 1).sample(paragraphs, len(paragraphs))


def split_data(
    forget_kind: list[Record], kept_kind: list[Record], unseen: list[Record], paragraphs: list[Record], sizes: Sizes
) -> BenchData:
    """The splits of :class:`BenchData` from known facts of each kind and the paragraphs (shuffled
    with fixed seeds here)."""
    forget_kind = random.Random(2).sample(forget_kind, len(forget_kind))
    kept_kind = random.Random(3).sample(kept_kind, len(kept_kind))
    n_forget, n_kept = round(sizes.forget_in_data * len(forget_kind)), round(sizes.kept_in_data * len(kept_kind))
    n_ref = round(sizes.reference_share * len(paragraphs))
    n_util = max(1, round(sizes.utility_share * len(paragraphs)))
    return BenchData(
        forget=forget_kind[:n_forget],
        held_forget=forget_kind[n_forget:],
        kept=kept_kind[:n_kept],
        held_kept=kept_kind[n_kept:],
        unseen=unseen,
        reference_text=paragraphs[:n_ref],
        general=paragraphs[n_ref : n_ref + n_util],
        held_general=paragraphs[n_ref + n_util :],
    )


def real_data(model: Any, tokenizer: Any, sizes: Sizes = Sizes()) -> BenchData:
    """The bench's data on the real model: the facts of each kind it knows, split, and its paragraphs."""
    kinds = {
        "capitals": known(model, tokenizer, fact_records(CAPITALS, "The capital of {} is")),
        "symbols": known(model, tokenizer, fact_records(SYMBOLS, "The chemical symbol of {} is")),
        "opposites": known(model, tokenizer, fact_records(OPPOSITES, "The opposite of {} is")),
    }
    listed = {"capitals": len(CAPITALS), "symbols": len(SYMBOLS), "opposites": len(OPPOSITES)}
    data = split_data(
        kinds["capitals"], kinds["symbols"], kinds["opposites"], model_paragraphs(model, tokenizer, sizes), sizes
    )
    known_of = {name: f"{len(items)} of {listed[name]}" for name, items in kinds.items()}
    return BenchData(**{**data.__dict__, "notes": {"known": known_of}})
