"""Small chat templates in the manner of each family's (written for the tests: the markers and the tool rendering
each family's template has, not the templates themselves)."""

HERMES = (  # Qwen2.5 / Hermes: tools in the system turn, calls in <tool_call> blocks
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}"
    "{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '\\n</tools>\\nCall as <tool_call>\\n{\"name\": ..., "
    "\"arguments\": ...}\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' }}{%- for call in message.tool_calls %}{{- '<tool_call>\\n' + "
    "({'name': call.function.name, 'arguments': call.function.arguments} | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
    "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}")
QWEN3 = HERMES.replace("'<|im_start|>assistant\\n' }}{%- endif %}",  # a thinking model of the same format
                       "'<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and not enable_thinking %}"
                       "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
LLAMA3 = (  # Llama 3.1: tools in the first user turn, answers as {"name", "parameters"}, <|python_tag|> calls
    "{{- bos_token }}{%- for message in messages %}{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|python_tag|>' }}{%- for call in message.tool_calls %}"
    "{{- '{\"name\": \"' + call.function.name + '\", \"parameters\": ' + (call.function.arguments | tojson) + '}' }}"
    "{%- endfor %}{{- '<|eom_id|>' }}{%- else %}{%- set role = 'ipython' if message.role == 'tool' else message.role %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}{%- if tools is not none and loop.last and "
    "message.role == 'user' %}{{- 'Answer with {\"name\": function name, \"parameters\": dictionary}. Functions:\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson(indent=4) + '\\n' }}{%- endfor %}{%- endif %}"
    "{{- message.content + '<|eot_id|>' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
MISTRAL = (  # Mistral v3: [AVAILABLE_TOOLS] before the last user turn, [TOOL_CALLS] and [TOOL_RESULTS] with 9-char ids
    "{{- bos_token }}{%- for message in messages %}{%- if message.role == 'user' %}{%- if tools and loop.last %}"
    "{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{{- '[INST]' + message.content + '[/INST]' }}{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '[TOOL_CALLS][' }}{%- for call in message.tool_calls %}{%- if call.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- {'name': call.function.name, 'arguments': call.function.arguments, 'id': call.id} | tojson }}"
    "{%- endfor %}{{- ']' + eos_token }}{%- elif message.role == 'tool' %}"
    "{{- '[TOOL_RESULTS]' + ({'content': message.content, 'call_id': message.tool_call_id} | tojson) + "
    "'[/TOOL_RESULTS]' }}{%- else %}{{- message.content + eos_token }}{%- endif %}{%- endfor %}")
PHI4_MINI = (  # Phi-4-mini: the tools ride on the system message, calls come as functools[...]
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] is "
    "not none %}{{ '<|system|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}"
    "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}")
GEMMA = (  # Gemma: no tool support in the template
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n{{ message['content'] }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
R1 = (  # DeepSeek-R1 distills: the generation prompt opens the thinking
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% else %}{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")
SMOLLM2 = (  # the embedded model's: ChatML without tools
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
