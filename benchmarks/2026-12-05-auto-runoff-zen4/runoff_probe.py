"""Does a longer probe on other prompts separate near-tied drafters? Dense target, methods interleaved."""
import sys, time
from viasd.engine import Engine
from viasd.spec import EngineSpec
from viasd.views.recipe import DENSE
from viasd.decode.base import GenerationConfig
from viasd.prompting import encode_prompt
from viasd import auto

PROMPTS = {
 "probe": (auto.PROBE_PROMPTS, 32),
 "runoff": ((
  "Summarize in three sentences: The city council met on Tuesday to discuss the new bicycle lanes planned for the "
  "river district. Supporters said the lanes would make the commute safer for the thousands of students who cycle "
  "to the university each day, and that shops along the route would gain customers. Opponents worried that removing "
  "two hundred parking spaces would hurt the same shops, and asked for a study of traffic on the bridge first. The "
  "council agreed to build the lanes in two stages, starting with the section by the university in spring, and to "
  "count cars and bicycles on the bridge before deciding on the second stage.",
  "A shop sells pencils at 3 for 45 cents and erasers at 2 for 30 cents. Tom buys 12 pencils and 5 erasers. How "
  "much does he pay? Think step by step.",
 ), 96),
}
methods = sys.argv[1].split(",")
eng = Engine(EngineSpec(quant=DENSE))
tok = eng.target.tokenizer if hasattr(eng, "target") else None
decs = {m: eng.decoder(m) for m in methods}
tokzr = next(iter(decs.values())).tokenizer
for d in decs.values():
    d.generate(encode_prompt(tokzr, "Hello"), GenerationConfig(max_new_tokens=4, ignore_eos=True))
for stage, (texts, n) in PROMPTS.items():
    cfg = GenerationConfig(max_new_tokens=n, ignore_eos=True)
    tot = {m: [0, 0.0, 0] for m in methods}
    for i, t in enumerate(texts):
        p = encode_prompt(tokzr, t)
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        for m in order:
            s = decs[m].generate(p, cfg).stats
            tot[m][0] += s.new_tokens; tot[m][1] += s.total_seconds; tot[m][2] += s.target_calls
    print(stage, {m: f"{a/b:.2f} tok/s, {a/c:.2f} per call" for m, (a, b, c) in tot.items()}, flush=True)
