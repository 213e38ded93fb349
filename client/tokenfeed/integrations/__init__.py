"""Recipes for trainers of other libraries, one module each, imported only when asked for.

:mod:`tokenfeed.integrations.hf`: Hugging Face ``transformers.Trainer``. Importing this
package imports nothing of those libraries; ``import tokenfeed`` never reaches here.
"""
