"""The chat page ``ktquest serve`` answers at ``/``: one HTML file, its script inline (no build step, nothing
fetched from elsewhere), talking to the server's own ``/v1/chat/completions`` with streamed replies.

What it does: a conversation (the messages kept in the page and sent whole each turn: the server's slots reuse
the cached prefix), a document attached as context (a text file read in the browser, or pasted; it opens the
first user message, as ``ChatSession(document=...)`` sends it), a Stop button (the request is aborted: the
server stops generating at the next token), and after each reply a stats line (prompt / cached / new tokens from
the stream's usage, time to first token and tok/s as the page saw them). Model text is put in the page as text,
never as HTML. An API key, when the server wants one, is asked for once and kept in the browser's storage.
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>ktquest</title>
<style>
body{font:15px/1.45 system-ui,sans-serif;margin:0;display:flex;flex-direction:column;height:100vh;background:#fafafa}
header{padding:8px 14px;background:#222;color:#eee;display:flex;gap:12px;align-items:center}
header b{font-weight:600} header span{opacity:.7;font-size:13px}
#log{flex:1;overflow:auto;padding:14px}
.msg{white-space:pre-wrap;margin:0 0 12px;padding:8px 11px;border-radius:8px;max-width:52em}
.user{background:#dde8ff;margin-left:auto}.assistant{background:#fff;border:1px solid #ddd}
.stats{font-size:12px;color:#666;margin:-8px 0 12px}
#doc{display:none;padding:8px 14px;background:#fff8e0;border-top:1px solid #eed}
#doc textarea{width:100%;height:8em;font:13px monospace}
form{display:flex;gap:8px;padding:10px 14px;border-top:1px solid #ddd;background:#fff}
#input{flex:1;font:inherit;padding:7px;min-height:2.4em;resize:vertical}
button{font:inherit;padding:6px 12px}
</style></head><body>
<header><b>ktquest</b><span id="model"></span><span id="docname"></span></header>
<div id="log"></div>
<div id="doc"><textarea id="doctext" placeholder="a document: the first message of the conversation opens with it">
</textarea></div>
<form id="form">
<textarea id="input" rows="2" placeholder="Message (Enter sends, Shift+Enter a new line)"></textarea>
<button type="button" id="attach">Document</button>
<input type="file" id="file" accept=".txt,.md,.py,.json,.csv,.html,.xml,text/*" hidden>
<button type="submit" id="send">Send</button><button type="button" id="stop" disabled>Stop</button>
<button type="button" id="reset">New chat</button>
</form>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
let messages = [], model = "ktquest", busy = null;
function headers() {
  const h = {"Content-Type": "application/json"}, key = localStorage.getItem("ktquest-key");
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}
async function api(path, init) {
  let r = await fetch(path, {...init, headers: headers()});
  if (r.status === 401) {
    const key = prompt("This server needs an API key:");
    if (key) { localStorage.setItem("ktquest-key", key); r = await fetch(path, {...init, headers: headers()}); }
  }
  return r;
}
function bubble(role, text) {
  const d = document.createElement("div");
  d.className = "msg " + role;
  d.textContent = text;
  $("log").appendChild(d);
  $("log").scrollTop = $("log").scrollHeight;
  return d;
}
function note(text) {
  const d = document.createElement("div");
  d.className = "stats";
  d.textContent = text;
  $("log").appendChild(d);
}
async function send(text) {
  const doc = $("doctext").value.trim();
  const content = messages.length === 0 && doc ? doc + "\\n\\n" + text : text;
  messages.push({role: "user", content});
  bubble("user", text);
  const out = bubble("assistant", "");
  const ctl = new AbortController();
  busy = ctl; $("stop").disabled = false; $("send").disabled = true;
  const t0 = performance.now();
  let first = 0, reply = "", usage = null, finish = null;
  try {
    const r = await api("/v1/chat/completions", {method: "POST", signal: ctl.signal, body: JSON.stringify(
      {model, messages, stream: true, stream_options: {include_usage: true}})});
    if (!r.ok) {
      const e = await r.json().catch(() => ({}));
      throw new Error((e.error && e.error.message) || r.status);
    }
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let i;
      while ((i = buf.indexOf("\\n\\n")) >= 0) {
        const line = buf.slice(0, i); buf = buf.slice(i + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const ev = JSON.parse(line.slice(6));
        if (ev.error) throw new Error(ev.error.message);
        if (ev.usage) usage = ev.usage;
        for (const c of ev.choices || []) {
          const piece = (c.delta && (c.delta.content || c.delta.reasoning_content)) || "";
          if (piece && !first) first = performance.now();
          reply += piece; out.textContent = reply;
          if (c.finish_reason) finish = c.finish_reason;
        }
        $("log").scrollTop = $("log").scrollHeight;
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") note("error: " + e.message); else finish = "stopped";
  }
  messages.push({role: "assistant", content: reply});
  const secs = (performance.now() - (first || t0)) / 1000;
  const parts = [];
  if (usage) parts.push(`${usage.prompt_tokens} prompt tokens (${usage.prompt_tokens_details.cached_tokens} cached)`,
                        `${usage.completion_tokens} new`);
  if (first) parts.push(`first token ${((first - t0) / 1000).toFixed(2)} s`);
  if (usage && secs > 0 && usage.completion_tokens > 1)
    parts.push(`${((usage.completion_tokens - 1) / secs).toFixed(1)} tok/s`);
  if (finish) parts.push(finish);
  note(parts.join(" · "));
  busy = null; $("stop").disabled = true; $("send").disabled = false;
}
$("form").onsubmit = (e) => {
  e.preventDefault();
  const t = $("input").value.trim();
  if (t && !busy) { $("input").value = ""; send(t); }
};
$("input").onkeydown = (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("form").requestSubmit(); } };
$("stop").onclick = () => busy && busy.abort();
$("reset").onclick = () => { messages = []; $("log").textContent = ""; };
$("attach").onclick = () => { const d = $("doc"); d.style.display = d.style.display === "block" ? "none" : "block"; $("file").click(); };
$("file").onchange = async () => {
  const f = $("file").files[0];
  if (f) { $("doctext").value = await f.text(); $("docname").textContent = "document: " + f.name; $("doc").style.display = "block"; }
};
api("/v1/models", {}).then((r) => r.json()).then((j) => { model = j.data[0].id; $("model").textContent = model; });
</script></body></html>
"""
