"""``--model``: from what the user names to a checkpoint directory.

    ""                  the embedded default (SmolLM2-135M-Instruct, fetched and converted once)
    path/to/model.gguf  a Llama or Qwen3 GGUF file, converted once into the cache
    an existing path    itself (``ModelConfig.from_pretrained`` says what is wrong with it)
    Org/Name            a Hugging Face hub id, through huggingface_hub

A hub id resolves like every Hugging Face library resolves it: from the local cache
(``HF_HUB_CACHE``, else ``HF_HOME/hub``: ``models--Org--Name/snapshots/<commit>/``, the commit
named by ``refs/main``), refreshed or downloaded when the hub is reachable, never contacted when
``HF_HUB_OFFLINE=1`` (huggingface_hub reads those variables itself). Only the files the engine
reads are downloaded (JSON configs and tokenizer, safetensors, chat templates). A model that can
be neither found in the cache nor downloaded is a ``HubError``: one line naming the id, where it
was looked for, and what to do.
"""

from __future__ import annotations

import re
from pathlib import Path

from engine.model.fetch import FetchError

HUB_FILES = ["*.json", "*.safetensors", "*.jinja"]
# huggingface_hub's repo id rule (validate_repo_id): [org/]name of word characters, '-' and '.',
# no '--' or '..'. Paths that start with '/', '.' or '~' never match.
_REPO_ID = re.compile(r"^(\b[\w\-.]+\b/)?\b[\w\-.]{1,96}\b$")


class HubError(FetchError):
    """A hub id that could not be resolved (not cached and not downloadable). One line."""


def is_hub_id(model: str) -> bool:
    return (bool(_REPO_ID.match(model)) and "--" not in model and ".." not in model
            and not model.endswith(".git"))


def resolve_model(model: str) -> Path:
    """The checkpoint directory ``--model`` names (see the module docstring)."""
    if not model:
        from engine.model.gguf_convert import default_model_dir

        return default_model_dir()
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        from engine.model.gguf_convert import gguf_model_dir

        return gguf_model_dir(path)
    if path.exists() or not is_hub_id(model):
        return path
    return hub_snapshot(model)


def model_name(model: str, model_dir: Path) -> str:
    """What to call the model ``--model`` named (the server's default served name): a hub id as
    given (as vLLM serves it), a GGUF file by its stem, else the checkpoint directory's name."""
    if model and is_hub_id(model) and not Path(model).expanduser().exists():
        return model
    if model.lower().endswith(".gguf"):
        return Path(model).stem
    return model_dir.name


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot directory of hub model ``repo_id`` (downloaded if needed)."""
    try:
        from huggingface_hub import constants, snapshot_download
        try:
            from huggingface_hub import errors
        except ImportError:  # before 0.24 the error classes lived in utils
            from huggingface_hub import utils as errors  # type: ignore[no-redef]
    except ImportError:  # a dependency, but an environment may lack it
        raise HubError(f"{repo_id!r} is not a local path, and resolving it as a Hugging Face "
                       "hub id needs the huggingface_hub package: pip install huggingface_hub, "
                       "or point --model at a checkpoint directory") from None
    cache = constants.HF_HUB_CACHE
    offline = bool(constants.HF_HUB_OFFLINE)
    not_local = f"{repo_id!r} is not a local path, and as a Hugging Face hub id it"
    elsewhere = (f"download it where the hub is reachable (`hf download {repo_id}`) and copy "
                 f"that cache into {cache}, or point --model at a checkpoint directory")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except errors.LocalEntryNotFoundError as e:
        if isinstance(e, getattr(errors, "IncompleteSnapshotError", ())):
            raise HubError(f"{repo_id!r}: its snapshot in the Hugging Face cache ({cache}) is "
                           "incomplete (an interrupted download?) and the hub cannot be "
                           f"reached to complete it: {elsewhere}") from None
        if offline:
            raise HubError(f"{not_local} is not in the Hugging Face cache ({cache}), and "
                           f"HF_HUB_OFFLINE=1 forbids downloading it: unset HF_HUB_OFFLINE, "
                           f"or {elsewhere}") from None
        cause = e.__cause__ or e
        raise HubError(f"{not_local} is not in the Hugging Face cache ({cache}), and the hub "
                       f"could not be reached ({type(cause).__name__}): check the network (or "
                       f"HF_ENDPOINT), or {elsewhere}") from None
    except errors.GatedRepoError:
        raise HubError(f"{repo_id!r} is a gated model on the Hugging Face hub: accept its terms "
                       "on the model page, then log in (`hf auth login`) or set HF_TOKEN") \
            from None
    except errors.RepositoryNotFoundError:
        raise HubError(f"{not_local} is not on the Hugging Face hub (or it is private: log in "
                       "with `hf auth login` or set HF_TOKEN); check the name") from None
    except errors.HfHubHTTPError as e:
        raise HubError(f"{repo_id!r}: the Hugging Face hub answered "
                       f"{' '.join(str(e).split())[:200]}") from None
    except (errors.HFValidationError, OSError) as e:
        raise HubError(f"{repo_id!r}: {type(e).__name__}: {' '.join(str(e).split())[:200]}") \
            from None
