import time, torch, json
from transformers import AutoModel
import modeling_xpress.compiled as compiled
from modeling_xpress.assets import load_smollm2
from modeling_xpress.benchmark import chat_prompt_ids
from modeling_xpress.demo import BUNDLED_CHECKPOINT, DEMO_PROMPTS
torch.set_num_threads(2)
target, tok = load_smollm2(dtype=torch.float32)
xpress = AutoModel.from_pretrained(str(BUNDLED_CHECKPOINT), trust_remote_code=True, dtype=torch.float32).eval()
prompts = chat_prompt_ids(tok, DEMO_PROMPTS)
real = compiled.weight_major_pays
res = {"plain": 0.0, "on": 0.0, "off": 0.0}; tokens = 0
with torch.inference_mode():
    target.generate(prompts[0], max_new_tokens=8, do_sample=False)
    target.generate(prompts[0], max_new_tokens=8, do_sample=False, assistant_model=xpress, num_assistant_tokens=3)
    for rnd in range(2):
        for i, ids in enumerate(prompts):
            order = ["plain", "on", "off"] if (rnd + i) % 2 == 0 else ["off", "on", "plain"]
            outs = {}
            for name in order:
                compiled.weight_major_pays = real if name != "off" else (lambda w, r, repeats=5: False)
                kw = {} if name == "plain" else {"assistant_model": xpress, "num_assistant_tokens": 3}
                t = time.perf_counter(); outs[name] = target.generate(ids, max_new_tokens=128, do_sample=False, **kw); res[name] += time.perf_counter() - t
            assert torch.equal(outs["on"], outs["plain"]) and torch.equal(outs["off"], outs["plain"])
            tokens += outs["plain"].shape[1] - ids.shape[1]
compiled.weight_major_pays = real
print({k: round(tokens / v, 2) for k, v in res.items()}, "tok/s;", "on vs plain", round(res["plain"] / res["on"], 3), "off vs plain", round(res["plain"] / res["off"], 3))
