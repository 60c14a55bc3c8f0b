"""Hand-built syncer inputs shared by the syncer tests: a two-fragment model (a layer and an
embedding), policies, and contribution frames written the way a learner unit writes them."""

import numpy as np

from diloco.algo import messages, payloads, quorum
from diloco.algo import syncer as sync
from diloco.algo.codecs import make_codec
from diloco.algo.fragments import Fragment
from diloco.algo.outer import make_outer

FP32 = make_codec("fp32")
W, B, E = ("layer", "w"), ("layer", "b"), ("embed",)
FRAGS = (Fragment(0, (B, W), 8, False), Fragment(1, (E,), 4, True))
THETA0 = (
    {W: np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(2, 3), B: np.array([0.5, -0.25], np.float32)},
    {E: np.array([1.0, 2.0, 3.0, 4.0], np.float32)},
)


def policy(K=1, gamma=0.0, tau=0, cap=1.0, outer=None, merge="average", **kw):
    grace = quorum.GraceConfig(K=K, gamma=gamma, cap_steps=cap, tau=tau)
    return sync.Policy(grace, outer or make_outer("average"), merge, "average", **kw)


def start(pol, M=2, frags=FRAGS, theta0=THETA0):
    return sync.init(pol, frags, theta0, {m: 0 for m in range(M)})


def frame(local, ref, *, learner=0, inc=0, seq=1, fragment=0, base_version=0, c_steps=1, c_tokens=8,
          codec=FP32, spec="fp32"):
    """A contribution as a learner unit writes it: the fragment's anchor - local, encoded."""
    diff = {p: np.asarray(ref[p], np.float32) - np.asarray(local[p], np.float32) for p in local}
    tensors, payload, _ = payloads.pack_fragment(diff, codec)
    return raw_frame(tensors, payload, learner=learner, inc=inc, seq=seq, fragment=fragment,
                     base_version=base_version, c_steps=c_steps, c_tokens=c_tokens, spec=spec)


def raw_frame(tensors, payload, *, learner=0, inc=0, seq=1, fragment=0, base_version=0, c_steps=1,
              c_tokens=8, spec="fp32"):
    header = {"kind": "contribution", "learner": learner, "incarnation": inc, "seq": seq,
              "fragment": fragment, "base_version": base_version, "version": base_version,
              "c_steps": c_steps, "c_tokens": c_tokens, "codec": spec, "delta_against": None,
              "tensors": tensors}
    return messages.encode(header, payload)


def shifted(values, by):
    """values + by * (1, 2, 3, ...): a distinct, exactly known move per tensor entry."""
    return {p: np.asarray(v, np.float32) + np.float32(by) * np.arange(1, v.size + 1, dtype=np.float32).reshape(v.shape)
            for p, v in values.items()}


def publishes(actions):
    return [a for a in actions if isinstance(a, sync.Publish)]


def merges(st):
    return [r for r in st.decisions if r["event"] == "merge"]
