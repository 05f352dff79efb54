"""What would it take for the slim tier to pay off? Replays a calibrated profile's gate selection under
other quality budgets and hypothetical costs or verifiers (docs/calibration.md).

Needs the work file that `viasd calibrate` leaves next to the profile (`<profile>.work`). It holds the
gate statistics of the chosen mask; older work files hold only the target's continuations of the
calibration prompts, and then the statistics are recomputed by teacher forcing (loads both models).

    python scripts/calibration_whatif.py src/viasd/profiles/qwen2.5-coder-0.5b__qwen2.5-coder-1.5b.json
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from viasd.bench.tasks import file_sha256
from viasd.models.loading import load_model
from viasd.routing.calibrate import (
    Costs,
    SequenceStats,
    cached_continuations,
    has_draft_confidence,
    load_stats,
    position_stats,
    select_policy,
    utc_now,
)
from viasd.routing.profile import load_profile, save_profile
from viasd.routing.teacher import model_logits, slim_logits, teacher_force
from viasd.verify.gates import Gate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--work", type=Path, help="work file (default: <profile>.work)")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument(
        "--write",
        type=Path,
        help="also write the profile re-selected with pre-gate candidates (same mask, costs, budget and tier shares)",
    )
    args = parser.parse_args()
    profile = load_profile(args.profile)
    work = args.work or args.profile.with_name(args.profile.name + ".work")
    cal = profile.calibration
    stats = load_stats(work, profile.search.get("study_key", ""), profile.masks[0])
    if stats is None or not has_draft_confidence(stats):  # older work files lack the drafter's confidence
        target = load_model(profile.target["name"], dtype=args.dtype)
        drafter = load_model(profile.drafter["name"], dtype=args.dtype)
        prompts = [("", text) for text in cal["prompts"]]
        pairs = cached_continuations(target, drafter, prompts, cal["new_tokens"], work, resume=True)
        stats = []
        for prompt, cont in pairs:
            seq = teacher_force(target.model, prompt + cont, len(prompt))
            slim = slim_logits(target.model, profile.masks[0], seq, profile.search.get("chunk", 8))
            stats.append(position_stats(model_logits(drafter.model, seq.ids, seq.start), slim, seq.full_logits))

    table = cal["costs"]
    seconds = table["seconds"]
    measured = Costs(
        tuple(table["lengths"]),
        tuple(seconds["drafter"]),
        tuple(seconds[f"slim:{table['slim_mask_index']}"]),
        tuple(seconds["full"]),
    )
    half = dataclasses.replace(measured, slim=tuple(0.5 * v for v in measured.full))
    perfect = [
        SequenceStats(s.kl, s.confidence, s.draft_ok, [True] * len(s), list(s.draft_ok), s.draft_top) for s in stats
    ]  # a slim verifier that always agrees with the target
    off, pregates = (0.0,), (0.0, 0.3, 0.5)
    scenarios = [
        ("as calibrated (budget 2%, every tier >= 5%)", stats, measured, 0.02, 0.05, off),
        ("as calibrated, with pre-gate candidates 0.3 and 0.5", stats, measured, 0.02, 0.05, pregates),
        ("budget 2%, tiers free", stats, measured, 0.02, 0.0, off),
        ("budget 2%, tiers free, with pre-gate candidates", stats, measured, 0.02, 0.0, pregates),
        ("budget 5%, tiers free", stats, measured, 0.05, 0.0, off),
        ("budget 10%, tiers free", stats, measured, 0.10, 0.0, off),
        ("slim pass at half a full pass, budget 2%", stats, half, 0.02, 0.0, off),
        ("slim verifier always right, measured cost, budget 2%", perfect, measured, 0.02, 0.0, off),
        ("slim always right and at half cost, budget 2%", perfect, half, 0.02, 0.0, off),
    ]
    gammas, caps = tuple(cal["gammas"]), tuple(cal["caps"])
    columns = "scenario | via tok/s | sd tok/s | via/sd | gate | gamma | cap | pre-gate | errors | tiers a/s/f"
    print(f"| {columns} |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, data, costs, budget, share, gates in scenarios:
        sel = select_policy(data, costs, gammas, caps, budget, min_tier_share=share, pregates=gates)
        p, pred = sel.policy, sel.prediction
        d = pred.decided
        print(
            f"| {name} | {pred.tokens_per_second:.2f} | {sel.sd_prediction.tokens_per_second:.2f} | "
            f"{pred.tokens_per_second / sel.sd_prediction.tokens_per_second:.2f} | "
            f"{p.signal} [{p.k_accept:.3g}, {p.k_full:.3g}] | {p.gamma} | {p.cap} | {p.pregate:g} | "
            f"{pred.error_rate:.3f} | "
            f"{d['accept']}/{d['slim']}/{d['full']} |"
        )

    if args.write:
        budget, share = cal["quality_budget"], cal["predicted"].get("min_tier_share", 0.0)
        sel = select_policy(stats, measured, gammas, caps, budget, min_tier_share=share, pregates=pregates)
        p = sel.policy
        reselected = {"from_sha256": file_sha256(args.profile), "pregates": list(pregates), "date": utc_now()}
        new = dataclasses.replace(
            profile,
            gate=Gate(p.signal, (p.k_accept, p.k_full)),
            gamma=p.gamma,
            cap=p.cap,
            pregate=p.pregate,
            calibration={**cal, "predicted": sel.to_dict(), "reselected": reselected},
        )
        save_profile(new, args.write)
        print(
            f"wrote {args.write}: {p.signal} [{p.k_accept:.3g}, {p.k_full:.3g}], gamma {p.gamma}, cap {p.cap}, "
            f"pre-gate {p.pregate:g}"
        )


if __name__ == "__main__":
    main()
