"""A small, deterministic, position-controlled retrieval set (FineWeb-PosQ layout).

Each passage is filler prose generated from built-in word lists, with one
unique fact ("<Name> keeps a <adjective> <object> in a house near <city>.")
planted as its first sentence, at the sentence boundary nearest its middle,
or as its last sentence.  The query asks for that fact without naming the
person.  Filler sentences mention the same cities and objects in other roles,
so a passage is only found when its embedding keeps the fact, wherever it sits.

It exists for tests and a quick demo; it is not a benchmark.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

NAMES = ("Alma", "Bruno", "Celia", "Dario", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Lars",
         "Mira", "Nils", "Olga", "Pavel", "Rosa", "Sami", "Tessa", "Umar", "Vera", "Willem", "Yara", "Zeno")
CITIES = ("Lisbon", "Oslo", "Krakow", "Valencia", "Tallinn", "Bergen", "Ghent", "Porto", "Turin", "Lyon",
          "Graz", "Malmo", "Split", "Cork", "Riga", "Basel")
OBJECTS = ("violin", "telescope", "bicycle", "typewriter", "kettle", "compass", "lantern", "clock", "chessboard",
           "canoe", "camera", "globe", "harp", "microscope", "sewing machine", "rocking chair")
ADJECTIVES = ("green", "silver", "wooden", "broken", "antique", "tiny", "enormous", "striped", "purple",
              "rusty", "golden", "painted")
SUBJECTS = ("The town council", "A local historian", "The weather office", "The harbour master", "Most visitors",
            "The school board", "An old guidebook", "The railway company", "Several farmers", "The museum staff",
            "A travelling merchant", "The city archive")
VERBS = ("reported", "noted", "explained", "argued", "remembered", "claimed", "wrote", "mentioned")
CLAUSES = (
    "that the market square was busy during the long autumn",
    "that the bridge over the river had been repaired after the storm",
    "that the winter was colder than anyone could remember",
    "that trains from {city} were often late in the evening",
    "that the old library near {city} opened a new reading room",
    "that a {obj} was once sold at the spring fair for a high price",
    "that the bakery on the main street changed its recipes",
    "that fishing boats returned early because of the fog",
    "that travellers from {city} liked to bring a {obj} as a gift",
    "that the hills behind the village turned yellow in summer",
    "that the annual festival drew crowds from {city}",
    "that repairing a {obj} takes patience and good light",
    "that the new road shortened the trip to {city} by an hour",
    "that the orchard produced fewer apples than last year",
)
CLASSES = ("beginning", "middle", "end")


def _filler(rng: random.Random) -> str:
    clause = rng.choice(CLAUSES).format(city=rng.choice(CITIES), obj=rng.choice(OBJECTS))
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {clause}."


def make_passages(n_per_class: int = 30, words: int = 200, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(passages, queries) records; fully determined by the arguments."""
    if n_per_class < 1:
        raise ValueError(f"n_per_class must be >= 1, got {n_per_class}")
    if words < 20:
        raise ValueError(f"words must be >= 20, got {words}")
    rng = random.Random(seed)
    triples = [(a, o, c) for a in ADJECTIVES for o in OBJECTS for c in CITIES]
    n = 3 * n_per_class
    if n > len(triples):
        raise ValueError(f"at most {len(triples) // 3} passages per class are available")
    rng.shuffle(triples)
    passages, queries = [], []
    for i in range(n):
        adj, obj, city = triples[i]
        span_class = CLASSES[i % 3]
        name = rng.choice(NAMES)
        fact = f"{name} keeps a {adj} {obj} in a house near {city}."
        sentences: list[str] = []
        while sum(len(s.split()) for s in sentences) < words - len(fact.split()):
            sentences.append(_filler(rng))
        at = {"beginning": 0, "middle": len(sentences) // 2, "end": len(sentences)}[span_class]
        sentences.insert(at, fact)
        text = " ".join(sentences)
        start = text.index(fact)
        pid, qid = f"p{i:04d}", f"q{i:04d}"
        passages.append({"id": pid, "text": text})
        queries.append({
            "id": qid,
            "text": f"Who keeps a {adj} {obj} near {city}?",
            "passage_id": pid,
            "span_class": span_class,
            "span": [start, start + len(fact)],
            "position": round((start + len(fact) / 2) / len(text), 4),
        })
    return passages, queries


def write_synthetic(out: str | os.PathLike, n_per_class: int = 30, words: int = 200, seed: int = 0) -> Path:
    """Write passages.jsonl, queries.jsonl and README.txt to `out` (atomically: temp dir, then rename)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    passages, queries = make_passages(n_per_class, words, seed)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for name, rows in (("passages.jsonl", passages), ("queries.jsonl", queries)):
            with open(tmp / name, "w", encoding="utf-8") as fh:
                for row in rows:
                    fh.write(json.dumps(row) + "\n")
        (tmp / "README.txt").write_text(
            "Synthetic position-controlled retrieval set written by `attncal eval --make-synthetic` "
            f"(n_per_class={n_per_class}, words={words}, seed={seed}).\n"
            "Each passage holds one planted fact at its beginning, middle or end; each query asks for one fact.\n"
            "For tests and demos only; not a benchmark.\n"
        )
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
