"""The data_prep stage of a run: the training refs deduplicated and decontaminated against every
eval suite (the batteries' own generated text included), one prepared file per ref under
`<run>/data_prep/`, and its provenance record, written last: the corpus counts only once the record
exists, and a redelivered run reads the record instead of preparing again."""

import dataclasses
import json
import pathlib
from dataclasses import dataclass
from typing import Any

import msgspec

from contracts.evals import ProvenanceStep
from contracts.manifest import DataPrepStage
from domain.curriculum import Curriculum
from training.data import prep, rows
from training.data.corpora import join_documents, load_documents, load_eval_suite
from training.engine.reporting import Reporter
from training.recipes.batteries import battery_suites
from training.recipes.gate_reports import write_record
from training.recipes.run_data import RunData

PROVENANCE_RECORD = "provenance.json"


@dataclass(frozen=True, slots=True)
class _Prepared:
    """What data preparation recorded: the prepared file per ref, and its provenance."""

    files: dict[str, str]
    steps: list[ProvenanceStep]
    input_digest: str
    output_digest: str


def prepare_data(cfg: DataPrepStage, data: RunData, plan: Curriculum, report: Reporter) -> str:
    """Prepare the run's training data (or read what an earlier attempt recorded), point `data`'s
    sources at the prepared files and report the provenance; the run summary's part."""
    directory = data.root / "data_prep"
    directory.mkdir(parents=True, exist_ok=True)
    record = directory / PROVENANCE_RECORD
    if record.exists():
        saved = json.loads(record.read_text())
        report.log("data_prep already done; using the prepared corpus")
    else:
        saved = _prepare(cfg, data, plan, directory)
        write_record(record, saved)  # last: the corpus counts only once this exists
    prepared = msgspec.convert(saved, _Prepared)
    data.sources = {name: f"file:{path}" for name, path in prepared.files.items()}
    report.provenance(prepared.steps, prepared.input_digest, prepared.output_digest)
    before = prepared.steps[0].before if prepared.steps else 0
    kept = prepared.steps[-1].after if prepared.steps else 0
    return f"data_prep {before} -> {kept} documents"


def _prepare(cfg: DataPrepStage, data: RunData, plan: Curriculum, directory: pathlib.Path) -> dict[str, Any]:
    """Deduplicate and decontaminate the training refs; write one prepared file per ref; the
    record (JSON) of what was done."""
    table = {name: rows.read_rows(data.refs[name]) for name in plan.train_refs if name in data.structured}
    sources = {
        name: [rows.row_text(r) for r in table[name]]
        if name in table
        else load_documents(src, seed=data.seed)
        for name, src in plan.train_refs.items()
    }
    suites = {
        name: data.structured_eval_texts(name)
        if name in data.structured
        else load_eval_suite(src, seed=data.seed)
        for name, src in plan.eval_refs.items()
    }
    suites.update(battery_suites(plan, data.seed))
    prepared = prep.prepare(
        sources,
        suites,
        exact=cfg.exact_dedup,
        near=cfg.near_dedup,
        shingle_words=cfg.shingle_words,
        permutations=cfg.minhash_permutations,
        bands=cfg.minhash_bands,
        jaccard=cfg.near_dup_jaccard,
        ngram=cfg.decontamination_ngram,
    )
    files = {}
    for i, (name, src) in enumerate(plan.train_refs.items()):
        if name in table:  # the surviving rows, as JSONL: the stages read them like the original
            path = directory / f"{i:02d}.jsonl"
            rows.write_rows(path, rows.kept_rows(table[name], sources[name], prepared.documents[name]))
        else:
            path = directory / f"{i:02d}.txt"
            path.write_text(join_documents(src, prepared.documents[name]), encoding="utf-8")
        files[name] = str(path)
    return {
        "files": files,
        "input_digest": prepared.input_digest,
        "output_digest": prepared.output_digest,
        "steps": [dataclasses.asdict(s) for s in prepared.steps],
    }
