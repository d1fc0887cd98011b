"""Evaluation: what a compressed model's quality is, against its base.

- `quality`: perplexity, KL divergence and top-1 agreement of two models on the same token ids
  (verify's logits check and evaluate-model both read them);
- `reference`: the base model's reference logits and the texts they are taken on;
- `sensitivity`: what each quantizable module costs at each precision (the mix to a budget);
- `harness`, `harness_vllm_child`: lm-eval-harness on a model, in this environment or vLLM's;
- `args`, `result`: evaluate-model's and sweep-recipe's parameters and results.
"""
