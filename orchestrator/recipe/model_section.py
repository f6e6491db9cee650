"""The recipe's ``model`` section: a preset or a Hugging Face checkpoint, checked by reading it.

Validating this section loads the model's sizes (``configs/model/*.yaml``, or a checkpoint's
``config.json``) and, for the live loop, its tokenizer; nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses

from orchestrator.models import hf_checkpoint
from orchestrator.models.presets import ModelPreset, available_presets, load_preset
from orchestrator.recipe.checks import RecipeError
from orchestrator.tasks.hf_tokenizer import HFTokenizer, TokenizerError
from orchestrator.tasks.tokenizer import CharTokenizer


#: The preset a recipe without ``model.preset`` or ``model.checkpoint`` trains.
DEFAULT_PRESET = "small"


@dataclasses.dataclass
class ModelSection:
  """The model: a preset (``configs/model/*.yaml``, seeded random weights) or a Hugging Face Qwen3 checkpoint.

  ``model: NAME`` in a recipe (or ``model=NAME``) is short for ``model.preset: NAME``. With a checkpoint the
  sizes come from its ``config.json``; a preset given beside it must agree with them.
  """

  preset: str | None = None  # None: the checkpoint's sizes, or DEFAULT_PRESET
  checkpoint: str | None = None  # a directory: config.json, *.safetensors (and tokenizer.json for the live loop)
  chat_template: bool = False  # live loop: prompts go through the checkpoint's chat template
  # engine.kl_beta > 0: the KL term's frozen reference (None: the weights the run starts from), a checkpoint of
  # the same family and sizes as the model trained
  reference_checkpoint: str | None = None

  @property
  def name(self) -> str:
    """What the run trains, for people: the preset's name or the checkpoint's directory."""
    return self.checkpoint or self.preset or DEFAULT_PRESET

  def load(self) -> ModelPreset:
    """The model's sizes (and, from a checkpoint, where its weights are; and the KL reference's checkpoint),
    checked.

    Raises:
      RecipeError: an unknown preset, a checkpoint directory that cannot be used, or the two disagreeing.
    """
    key = (self.preset, self.checkpoint, self.reference_checkpoint)
    if key not in _LOADED_MODELS:
      loaded = self._load()
      _LOADED_MODELS[key] = dataclasses.replace(loaded, reference_checkpoint=self._reference(loaded))
    return _LOADED_MODELS[key]

  def _reference(self, trained: ModelPreset) -> str | None:
    """``reference_checkpoint``, checked against the model trained (``trained``): a usable checkpoint of its
    family and sizes."""
    if self.reference_checkpoint is None:
      return None
    given = f"model.reference_checkpoint={self.reference_checkpoint}"
    try:
      reference = hf_checkpoint.load_preset_from_checkpoint(self.reference_checkpoint)
    except hf_checkpoint.CheckpointDirError as e:  # its message names model.checkpoint, which this is not
      raise RecipeError(f"{given}: {str(e).removeprefix(f'model.checkpoint={self.reference_checkpoint}: ')}") from None
    differs = hf_checkpoint.disagreement(trained, reference)
    if differs:
      raise RecipeError(f"{given} is not a checkpoint of the model trained ({self.name}): the model has {differs};"
                        " give a checkpoint of the same family and sizes, or drop it (the reference is then the"
                        " weights the run starts from)")
    settings = hf_checkpoint.reference_differences(trained, reference)
    if settings:
      raise RecipeError(f"{given} runs with other settings than the model trained ({self.name}): its"
                        f" {hf_checkpoint.CONFIG_FILE} has {', '.join(settings)}; the KL term computes the reference"
                        " with the trained model's settings, so its KL would be to another model: give a checkpoint"
                        " whose settings match, or drop it (the reference is then the weights the run starts from)")
    return self.reference_checkpoint

  def _load(self) -> ModelPreset:
    if self.preset is not None and self.preset not in available_presets():
      raise RecipeError(f"model.preset={self.preset!r} is not a preset; available: {', '.join(available_presets())}"
                        " (or give model.checkpoint=DIR)")
    if self.checkpoint is None:
      return load_preset(self.preset or DEFAULT_PRESET)
    try:
      loaded = hf_checkpoint.load_preset_from_checkpoint(self.checkpoint)
    except hf_checkpoint.CheckpointDirError as e:
      raise RecipeError(str(e)) from None
    if self.preset is not None:
      named = load_preset(self.preset)
      differs = hf_checkpoint.disagreement(named, loaded)
      if differs:
        raise RecipeError(f"model.preset={self.preset} and model.checkpoint={self.checkpoint} disagree: the preset"
                          f" has {differs}; drop model.preset (the checkpoint's sizes are used) or name the"
                          " matching preset")
      loaded = dataclasses.replace(loaded, rows=named.rows, tokens_per_row=named.tokens_per_row)
    return loaded

  def context_tokens(self) -> int | None:
    """The longest sequence the checkpoints' models were trained for (``max_position_embeddings``): the trained
    model's, or the KL reference's where that is shorter (``context_source`` says which); None for a preset
    without a reference (its positions are not limited)."""
    limits = [(tokens, key) for key, path in (("model.checkpoint", self.checkpoint),
                                              ("model.reference_checkpoint", self.reference_checkpoint))
              if path is not None and (tokens := self._context_of(key, path)) is not None]
    return min(limits)[0] if limits else None

  def context_source(self) -> str:
    """Whose ``max_position_embeddings`` ``context_tokens`` is, as the refusals name it."""
    limits = [(self._context_of(key, path), key) for key, path in (
        ("model.checkpoint", self.checkpoint), ("model.reference_checkpoint", self.reference_checkpoint))
              if path is not None]
    return f"max_position_embeddings in {min(limits)[1]}'s {hf_checkpoint.CONFIG_FILE}" if limits else "none"

  @staticmethod
  def _context_of(key: str, path: str) -> int:
    try:
      return hf_checkpoint.context_tokens(hf_checkpoint.read_config(path), f"{key} {path}/{hf_checkpoint.CONFIG_FILE}")
    except hf_checkpoint.CheckpointDirError as e:
      raise RecipeError(str(e)) from None

  def tokenizer(self):
    """The live loop's tokenizer: the checkpoint's own, else the character tokenizer.

    Raises:
      RecipeError: the checkpoint has no usable tokenizer, or a chat template is asked of one without.
    """
    if self.checkpoint is None:
      return CharTokenizer()
    try:
      return HFTokenizer(self.checkpoint, chat_template=self.chat_template)
    except TokenizerError as e:
      raise RecipeError(str(e)) from None

  def validate(self) -> None:
    if self.chat_template and self.checkpoint is None:
      raise RecipeError("model.chat_template=true needs model.checkpoint=DIR (a preset's character tokenizer has"
                        " no chat template); give a checkpoint or drop model.chat_template")
    self.load()


#: Checked models by (preset, checkpoint, reference checkpoint): a recipe is validated, then read by every part
#: that builds.
_LOADED_MODELS: dict[tuple[str | None, str | None, str | None], ModelPreset] = {}
