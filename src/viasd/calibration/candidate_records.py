"""Gate records of the candidates: what each drafter and slim view predicts along the teacher-forced
sequences (records.py's records), kept in the work file because every view costs a pass per sequence."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from viasd.calibration.candidates import DraftSource, SlimCandidate
from viasd.calibration.progress import steps
from viasd.calibration.records import GateRecords, gate_records
from viasd.calibration.teacher import TeacherSequence, slim_logits
from viasd.calibration.workfile import WorkFile, work_key
from viasd.models.fingerprint import model_fingerprint
from viasd.models.loading import LoadedModel


def records_for(
    target: LoadedModel,
    source: DraftSource,
    sequences: Sequence[TeacherSequence],
    views: Sequence[SlimCandidate],
    chunk: int,
    work: WorkFile,
    resume: bool,
    progress: bool = False,
) -> list[GateRecords]:
    """Gate records of the slim views (one list per view inside each record) along the teacher-forced
    sequences, with `source`'s drafts; kept in the work file."""
    key = work_key(
        "records",
        model_fingerprint(target.model),
        *source.identity(),
        str(next(target.model.parameters()).dtype),
        chunk,
        [v.describe() for v in views],
        [(seq.start, seq.ids) for seq in sequences],
    )
    cached = work.get(key) if resume else None
    if isinstance(cached, list):
        return [GateRecords.from_dict(seq) for seq in cached]
    records = []
    for seq in steps(sequences, "gate records", progress):
        logits = [slim_logits(target.model, v.view, seq, chunk) for v in views]
        records.append(gate_records(source.logits(seq), logits, seq.full_logits))
    work.put(key, [asdict(seq) for seq in records])
    return records
