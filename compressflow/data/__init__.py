"""Calibration data: where rows come from, how they become text and tokens.

- `args`: the slice's parameters (`DatasetArgs`, `HeldOutArgs`);
- `result`: what its stages return (`BuiltDataset`, `HeldOutText`);
- `build`: the calibration dataset (sampled, tokenized, saved under its fingerprint) and the
  held-out evaluation text;
- `text_sources`: the sources (a loader, a shortcut, a local file or folder, a hub id), their
  readers, turning rows into text and sampling them;
- `tokenizer`: the tokenizer contract: loading the model's tokenizer or processor, its chat
  template, tokenizing;
- `vision`: image+text rows through the model's processor;
- `local_text`: the texts of the offline `python_docs` shortcut and the verification prompts;
- `user_code`: allow-listed `module:function` loaders and collators.
"""
