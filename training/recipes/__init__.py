"""The training recipes: the staged pipeline, the data ladder, pretrain / midtrain / long-context, SFT, DPO, RLVR, evals."""
