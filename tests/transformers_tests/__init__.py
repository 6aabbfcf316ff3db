"""transformers' common model tests (`ModelTesterMixin`, `ConfigTester`, `ProcessorTesterMixin`), imported as they are
inside transformers' own repository.

The test files come from the source distribution of the installed transformers, unpacked into the virtual
environment by `make setup` (`fetch.py`). That distribution lacks a few modules those files import
(`tests/generation`, `tests/exporters`, `tests/utils`, and `utils/fetch_hub_objects_for_ci.py` beside `tests/`): this
package holds the zoo's own versions of them, and puts the unpacked folder on its own path so that
`from transformers_tests.test_modeling_common import ModelTesterMixin` resolves the mixins' relative imports here.
"""

import importlib
import sys

from .fetch import unpacked_tests_dir


_unpacked = unpacked_tests_dir()
if not (_unpacked / "test_modeling_common.py").is_file():
    raise ImportError(
        f"transformers' common tests are not unpacked in {_unpacked}: run `make setup` "
        "(or `python tests/transformers_tests/fetch.py` with the project's interpreter)"
    )
__path__.append(str(_unpacked))

# test_processing_common.py imports this module by its bare name from a `utils/` folder the distribution lacks.
sys.modules.setdefault("fetch_hub_objects_for_ci", importlib.import_module(f"{__name__}.fetch_hub_objects_for_ci"))
