"""Device check for the serving path: Retriever with index AND scorer on CUDA equals the CPU answer
(hashed two-tower and a random-weight MoE; fp32/fp16/int8; batched and alone), and the service's
split (user state built on the CPU by the router, searched by a CUDA shard).

Run on a GPU machine from the repo root: `python scripts/device_check_retrieval.py [ADS] [DEVICE]`
(default 20000 cuda); `... 300 cpu` is a quick dry run here. Last run: H200, 50k ads, every line
True (docs/benchmarks.md does not hold these numbers: the reference pipeline is not the fused kernel)."""
import copy, json, sys, tempfile, time
from pathlib import Path
import torch

from andromeda_core.index import AdIndex
from andromeda_core.ops import PreparedAd
from andromeda_core.ingest import prepare_ops, read_events
from andromeda_core.models.retrieval import RetrievalModel
from andromeda_core.models.serving import ModelScorer
from andromeda_core.models.towers import Dims
from andromeda_core.models.two_tower import HashedTwoTower
from andromeda_core.quantization import STORAGE
from andromeda_core.retriever import Retriever, UserQuery, compile_requests
from andromeda_core.schema import load_schema
from andromeda_core.synth import WorldConfig, synthesize
from andromeda_core.types import parse_request

ads = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
DEV = sys.argv[2] if len(sys.argv) > 2 else "cuda"
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
schema = load_schema()
world = synthesize(WorldConfig(ads=ads, users=64, seed=5), Path(tempfile.mkdtemp()) / "w", schema)
base = [op for b in read_events(world / "events.jsonl") for op in prepare_ops(schema, HashedTwoTower(), b)]
requests = [parse_request({**json.loads(l), "k": 50}) for l in (world / "requests.jsonl").read_text().splitlines()]
print(f"{len(base)} ops, {len(requests)} requests on {torch.cuda.get_device_name() if DEV == 'cuda' else DEV}", flush=True)

torch.manual_seed(0)
upserts = [op for op in base if isinstance(op, PreparedAd)]
moe = RetrievalModel("moe", Dims(), [op.ad.ad_id for op in upserts[::2]]).eval()  # half the ads with learned ids
with torch.no_grad():
    moe.ad_tower.identity.weight[:-1].normal_()
    stored = moe.ad_tower(torch.randn(len(upserts), 384), torch.randint(0, 60, (len(upserts),)),
                          torch.tensor([op.ad.advertiser_id for op in upserts]), torch.tensor([op.ad.bid for op in upserts]),
                          moe.id_rows(torch.tensor([op.ad.ad_id for op in upserts])),
                          torch.zeros(len(upserts), moe.dims.dim))  # mentions none
moe_vec = {id(op): v.numpy() for op, v in zip(upserts, stored)}
moe_ops = [PreparedAd(op.ad, op.targeting, moe_vec[id(op)]) if isinstance(op, PreparedAd) else op for op in base]
scorers = {"two_tower": (lambda d: HashedTwoTower(device=d), base), "moe": (lambda d: ModelScorer(copy.deepcopy(moe), [], schema, device=d), moe_ops)}
ids = lambda rs: [[a.ad_id for a in x.ads] for x in rs]
for name, (make, ops) in scorers.items():
    for storage in ("fp32", "fp16", "int8"):
        out = {}
        for key, dev in (("cpu", "cpu"), ("dev", DEV)):
            scorer = make(dev)
            index = AdIndex(schema, scorer.dim, 1024, dev, STORAGE[storage]); index.apply(ops)
            r = Retriever(index, scorer); r.retrieve(requests[:2]); sync()
            t = time.perf_counter(); batched = r.retrieve(requests); sync()
            out[key] = (batched, [r.retrieve([q])[0] for q in requests[:8]], (time.perf_counter() - t) * 1000)
        diff = max(abs(a.score - b.score) for x, y in zip(out["cpu"][0], out["dev"][0]) for a, b in zip(x.ads, y.ads))
        print(f"{name:9} {storage}: ids cpu==dev {ids(out['cpu'][0]) == ids(out['dev'][0])}, eligible equal "
              f"{[x.eligible for x in out['cpu'][0]] == [x.eligible for x in out['dev'][0]]}, dev batch==alone "
              f"{ids(out['dev'][1]) == ids(out['dev'][0][:8])}, max |score diff| {diff:.2e}, 64-request pass cpu "
              f"{out['cpu'][2]:.0f} ms, dev {out['dev'][2]:.1f} ms", flush=True)
    cpu_scorer, dev_scorer = make("cpu"), make(DEV)
    cpu_index = AdIndex(schema, cpu_scorer.dim, 1024, "cpu"); cpu_index.apply(ops)
    dev_index = AdIndex(schema, dev_scorer.dim, 1024, DEV); dev_index.apply(ops)
    compiled = compile_requests(schema, requests)
    nows = [c.now for c in compiled]
    users = Retriever(cpu_index, cpu_scorer).encode(requests, nows)  # on the CPU, as the router builds it
    query = UserQuery(users, [c.values for c in compiled], nows, [r.k for r in requests])
    got, want = Retriever(dev_index, dev_scorer).search(query), Retriever(cpu_index, cpu_scorer).search(query)
    print(f"{name:9} router on cpu -> shard on {DEV}: ids equal {torch.equal(got.ids, want.ids)}, "
          f"eligible equal {torch.equal(got.eligible, want.eligible)}", flush=True)
