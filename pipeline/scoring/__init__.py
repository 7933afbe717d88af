"""Examples as token rows and their layouts (padded, packed, prompts shared), and answers' log-probabilities
scored over them: what post-training trains and measures with and what evaluate measures post-training with. A
library below both: post and evaluate import it, it imports neither."""
