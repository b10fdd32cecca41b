"""Jinja chat templates for the tiny GLM-5.3 and Qwen3.8 tokenizers.

Written for these tests in the shape the families' formats take (field notes §6):
GLM puts `<think>`/`</think>` after `<|assistant|>` and writes tools as
`<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`; Qwen uses
ChatML with `<tool_call><function=NAME><parameter=K>v</parameter></function></tool_call>`.
Both honour `enable_thinking` (default on). DeepSeek-V4 has no jinja template:
vLLM renders its prompts with its own encoder.
"""

GLM5_CHAT_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions. Their signatures, one JSON object a line:
{% for tool in tools %}{{ tool | tojson }}
{% endfor -%}
Write each call as <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>.
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
<|system|>
{{ message.content }}
{%- elif message.role == 'user' -%}
<|user|>
{{ message.content }}
{%- elif message.role == 'assistant' -%}
<|assistant|>
{%- if message.reasoning_content -%}<think>{{ message.reasoning_content }}</think>{%- else -%}</think>{%- endif -%}
{{ message.content or '' }}
{%- for call in message.tool_calls or [] -%}
<tool_call>{{ call.function.name }}
{%- if call.function.arguments is mapping -%}
{%- for key, value in call.function.arguments.items() -%}
<arg_key>{{ key }}</arg_key><arg_value>{{ value if value is string else value | tojson }}</arg_value>
{%- endfor -%}
{%- else -%}{{ call.function.arguments }}{%- endif -%}
</tool_call>
{%- endfor -%}
{%- elif message.role == 'tool' -%}
<|observation|><tool_response>{{ message.content }}</tool_response>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>{{ '</think>' if enable_thinking is defined and not enable_thinking else '<think>' }}
{%- endif -%}"""

QWEN3_CHAT_TEMPLATE = """
{%- set system = messages[0].content if messages and messages[0].role == 'system' else none -%}
{%- if tools -%}
<|im_start|>system
{% if system %}{{ system }}

{% endif -%}
# Tools

You may call one or more functions. Their signatures are inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor -%}
</tools>

Call a function as:
<tool_call>
<function=NAME>
<parameter=KEY>
VALUE
</parameter>
</function>
</tool_call><|im_end|>
{% elif system -%}
<|im_start|>system
{{ system }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'user' -%}
<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' -%}
<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
<tool_call>
<function={{ call.function.name }}>
{% if call.function.arguments is mapping -%}
{% for key, value in call.function.arguments.items() -%}
<parameter={{ key }}>
{{ value if value is string else value | tojson }}
</parameter>
{% endfor -%}
{% endif -%}
</function>
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif -%}
{%- endif -%}"""
