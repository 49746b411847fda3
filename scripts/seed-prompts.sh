#!/usr/bin/env bash
# Post the three seed coding prompts to a running server (flashdraft or llama-server) and
# print tokens/s, drafted/accepted tokens and usage per answer. Needs curl and jq.
#   scripts/seed-prompts.sh [URL] [TEMPERATURE] [MAX_TOKENS]
set -euo pipefail
url=${1:-http://127.0.0.1:8080}
temp=${2:-0.7}
max=${3:-1200}
prompts=(
  "Write a complete Python task store module. Include a Task dataclass, TaskStatus enum, TaskStore class, add_task, update_task, delete_task, search_tasks, filter_by_status, export_to_json, get_all_tasks, and 5 tests. Return only one complete Python file."
  "Write a complete Python key-value report module. Include a KeyValueStore class, set, get, delete, exists, list_keys, filter_by_prefix, export_to_json, load_from_json, and a generate_report function that returns total keys, empty values, prefix counts, and largest value length. Include 5 tests. Return only one complete Python file."
  "Write a complete Python doubly linked list module. Include a Node dataclass, DoublyLinkedList class, append, prepend, delete, find, reverse, to_list, from_list, clear, and 5 tests. Return only one complete Python file."
)
for p in "${prompts[@]}"; do
  jq -n --arg p "$p" --argjson t "$temp" --argjson m "$max" \
     '{messages: [{role: "user", content: $p}], temperature: $t, max_tokens: $m}' |
  curl -sf "$url/v1/chat/completions" -H 'Content-Type: application/json' ${LLAMA_API_KEY:+-H "Authorization: Bearer $LLAMA_API_KEY"} -d @- |
  jq -c '{predicted_per_second: .timings.predicted_per_second, draft_n: .timings.draft_n,
          draft_n_accepted: .timings.draft_n_accepted, usage: .usage}'
done
