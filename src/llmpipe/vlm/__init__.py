"""Vision-language models: the LLaVA model and processor (`model`) and held-out
accuracy by question type (`scoring`). The `vlm` stage (`llmpipe.stages.vlm`) composes them."""
