"""The recipe engine: any accepted recipe form becomes one validated llm-compressor recipe.

Accepted forms: `RecipeArgs.preset` (a name from `compressflow.registries.presets`), or in
`RecipeArgs.recipe` YAML text or a path to a .yaml/.yml file holding a recipe mapping
(`<name>_stage: <group>_modifiers: {Modifier: kwargs}`) or a list of `{Modifier: kwargs}`, which
becomes one stage (a dict or list given from Python arrives as YAML text).

Steps, one module each, plain functions so they can be tested without Prefect; `render.render`
runs them in order and `tasks/render_recipe.py` is the stage around it:
1. `load`: the form becomes parsed YAML data (YAML only through `compressflow.limits.load_yaml`:
   the safe loader, with caps on size, depth and alias expansion).
2. `placeholders`: `$name` / `${name}` placeholders in *values* take the `recipe_args` (dict keys
   are never substituted). A value that is exactly one placeholder takes the argument with its
   type; a placeholder inside a longer string is replaced by `str(value)`. Inserted values are not
   scanned again. A `$` not followed by an identifier (the regex `re:.*lm_head$`) is left alone.
   Missing and unused names are errors, so a typo can never leave a half-rendered recipe.
3. `migrate`: lists become one stage; forms llm-compressor 0.14 no longer takes (a string
   `observer`, `run_type`, SmoothQuant `mappings` naming a model family, `sequential_targets`
   inside a modifier) are rewritten, with a note for each. Forms that cannot be rewritten
   (SparseZoo `zoo:` stubs) are refused with the form that replaces them.
4. `validate`: llm-compressor's own parser (`Recipe.from_dict`) builds the modifiers; its errors
   become `RecipeError`s that name the modifier, the field and the fix.
`tree` walks and writes a recipe in llm-compressor's YAML shape for all of them.
"""

# The parameters every recipe error points at.
RECIPE_FIELD = "recipe.recipe"
ARGS_FIELD = "recipe.recipe_args"
