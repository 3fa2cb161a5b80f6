"""Names shared by the kernels and `uniprefill.config`; importing this module imports nothing."""

IMPLS = ("auto", "triton", "torch")  # see `api` for what each picks

# The top-p rules of `api.select_blocks`: "paper" counts the forced (sink and window) blocks'
# score toward p; "content" asks p of the free blocks' score from free blocks alone.
SELECTIONS = ("paper", "content")
