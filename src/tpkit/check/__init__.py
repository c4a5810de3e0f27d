"""What `tpkit verify` and `tpkit calibrate` run: checks and measurements of this build on
this machine.

    exactness.py   a model or MLP at any tp against the tp=1 reference (`tpkit verify`)
    measure.py     the timings `tpkit calibrate` fits (GEMMs, element-wise, dispatch,
                   all-reduce over local processes); the fits are pure Python (`tpkit.plan.fit`)

(The Hugging Face check, any tp against transformers itself, lives with the weights:
`tpkit.weights.hf_check`.)
"""
