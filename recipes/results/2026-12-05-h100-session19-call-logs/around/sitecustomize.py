# session 19 (call 4): with this directory first on PYTHONPATH, blocks with Hugging Face's experts compile around
# them (the experts eager between two graphs, the default until this session) instead of whole. For the
# side-by-side measurement only.
from megatrain_lightning.engine import compiled

compiled.inside_graphs = lambda experts: False
