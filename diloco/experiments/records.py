"""The fine-tuning task of docs/finetuning.md: read one sentence about a person and answer with a
strict one-line record, `name=<name>|year=<year>|city=<city>|job=<job>`.

The facts appear in many phrasings and orders, so the answer is an extraction and a reordering,
not a copy; the output format is ours, so a model that was never trained on it scores near zero
however well it reads. Every example is a pure function of (seed, index), and the held-out split
draws from a seed stream the training split never uses, with any sentence that also occurs in
training removed, so a held-out score measures reading unseen sentences, not recall.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

FIELDS = ("name", "year", "city", "job")

FIRST = ("Amara", "Bruno", "Chen", "Dana", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kavya",
         "Luca", "Maya", "Nikolai", "Olga", "Pedro", "Quinn", "Rosa", "Samir", "Tomas", "Uma", "Viktor",
         "Wen", "Ximena", "Yusuf", "Zara", "Aiko", "Bilal", "Clara", "Diego", "Esther", "Felix", "Hana",
         "Ivan", "Julia", "Kofi", "Leila", "Mateo", "Nadia", "Oscar", "Priya", "Rafael", "Sofia", "Theo")
LAST = ("Abbott", "Bauer", "Costa", "Dubois", "Eriksen", "Fischer", "Garcia", "Haddad", "Ito", "Jansen",
        "Kowalski", "Lindqvist", "Moreau", "Nakamura", "Okafor", "Petrov", "Quispe", "Rossi", "Silva",
        "Tanaka", "Ueda", "Varga", "Weber", "Xu", "Yilmaz", "Zhou", "Alvarez", "Becker", "Novak", "Singh")
CITIES = ("Lisbon", "Osaka", "Nairobi", "Toronto", "Krakow", "Lyon", "Dublin", "Seoul", "Austin", "Lima",
          "Porto", "Oslo", "Cairo", "Hanoi", "Quito", "Bergen", "Tunis", "Perth", "Leeds", "Turin",
          "Graz", "Ghent", "Malmo", "Busan", "Accra", "Cusco", "Haifa", "Basel", "Bilbao", "Dakar")
JOBS = ("nurse", "baker", "pilot", "teacher", "chemist", "plumber", "architect", "librarian", "farmer",
        "journalist", "dentist", "carpenter", "translator", "geologist", "florist", "electrician",
        "photographer", "surgeon", "mechanic", "violinist", "economist", "tailor", "firefighter", "chef")

# Each template names all four facts once; orders and wordings vary so position does not give the
# answer away. {a} is "a" or "an" before the job.
TEMPLATES = (
    "{name} is {a} {job} from {city}, born in {year}.",
    "Born in {year}, {name} now lives in {city} and works as {a} {job}.",
    "In {city} you may meet {name}, {a} {job} who was born in {year}.",
    "The {job} {name} ({year}) has spent most of their life in {city}.",
    "{city} is home to {name}; born in {year}, they work as {a} {job}.",
    "Working as {a} {job} in {city}, {name} was born in the year {year}.",
    "{name}, born {year}, is {a} {job} based in {city}.",
    "Since moving to {city}, {name} (born in {year}) has been {a} {job}.",
    "{a_cap} {job} born in {year}, {name} lives in {city}.",
    "Ask anyone in {city} about {name}: {a} {job}, born in {year}.",
)

INSTRUCTION = ("Extract the person's details from the sentence. Answer with one line in exactly this "
               "format: name=<full name>|year=<birth year>|city=<city>|job=<job>\nSentence: ")

# Split streams: index i of split s uses random.Random(f"{seed}:{s}:{i}"), so no two splits share a draw.
_SPLITS = ("train", "test")


def record(rng: random.Random) -> dict[str, str]:
    return {"name": f"{rng.choice(FIRST)} {rng.choice(LAST)}", "year": str(rng.randint(1940, 2005)),
            "city": rng.choice(CITIES), "job": rng.choice(JOBS)}


def answer(rec: dict[str, str]) -> str:
    return "|".join(f"{k}={rec[k]}" for k in FIELDS)


def sentence(rec: dict[str, str], template: str) -> str:
    a = "an" if rec["job"][0] in "aeiou" else "a"
    return template.format(**rec, a=a, a_cap=a.capitalize())


def example(seed: int, split: str, i: int) -> dict[str, str]:
    """One {"prompt", "response"} pair: the i-th of a split."""
    if split not in _SPLITS:
        raise ValueError(f"split {split!r} not in {_SPLITS}")
    rng = random.Random(f"{seed}:{split}:{i}")
    rec = record(rng)
    return {"prompt": INSTRUCTION + sentence(rec, rng.choice(TEMPLATES)), "response": answer(rec)}


def splits(seed: int, train: int, test: int) -> tuple[list[dict], list[dict]]:
    """`train` training pairs and `test` held-out pairs whose sentences never occur in training."""
    tr = [example(seed, "train", i) for i in range(train)]
    seen = {e["prompt"] for e in tr}
    te, i = [], 0
    while len(te) < test:
        e = example(seed, "test", i)
        i += 1
        if e["prompt"] not in seen:
            seen.add(e["prompt"])
            te.append(e)
    return tr, te


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def parse(reply: str) -> dict[str, str] | None:
    """The fields of a reply's first non-empty line, or None when it is not exactly the four
    fields in order (a missing, extra, renamed or reordered field fails the format)."""
    lines = [s.strip() for s in reply.strip().splitlines() if s.strip()]
    if not lines:
        return None
    parts = lines[0].split("|")
    if len(parts) != len(FIELDS):
        return None
    out = {}
    for key, part in zip(FIELDS, parts):
        k, sep, v = part.partition("=")
        if not sep or k.strip() != key:
            return None
        out[key] = v.strip()
    return out


def score(replies: list[str], answers: list[str]) -> dict[str, float]:
    """exact: the reply's first line equals the answer; format: it parses as a record; fields: the
    share of the four fields right (0 for a reply that does not parse)."""
    if len(replies) != len(answers) or not answers:
        raise ValueError(f"{len(replies)} replies for {len(answers)} answers")
    exact = fmt = fields = 0.0
    for reply, ans in zip(replies, answers):
        lines = [s.strip() for s in reply.strip().splitlines() if s.strip()]
        exact += bool(lines) and lines[0] == ans
        got, want = parse(reply), parse(ans)
        if got is not None:
            fmt += 1
            fields += sum(got[k] == want[k] for k in FIELDS) / len(FIELDS)
    n = len(answers)
    return {"exact": exact / n, "format": fmt / n, "fields": fields / n, "n": n}
