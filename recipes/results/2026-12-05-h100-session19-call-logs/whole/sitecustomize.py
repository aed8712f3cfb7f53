# session 19 (call 3): with this directory first on PYTHONPATH, blocks with Hugging Face's experts compile whole
# (compiled.experts_of finds none, so CompiledBlocks compiles no block around its experts) under
# strategy.engine.compile_blocks=true. For the side-by-side measurement only.
from megatrain_lightning.engine import compiled

compiled.experts_of = lambda block: []
