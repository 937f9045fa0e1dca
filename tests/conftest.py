import torch

# The test models are tiny: one thread is as fast as two and keeps timings steady on a shared 2-core machine.
torch.set_num_threads(1)
