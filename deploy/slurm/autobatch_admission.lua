-- autobatch's admission decision for Slurm's Lua plugins (job_submit.lua in slurmctld,
-- cli_filter.lua in sbatch/srun/salloc): reads the job's model, batch and GPUs, asks the
-- central service's POST /v1/admissions with a hard bound, and caches recent answers.
-- Installed beside them (docs/deploy.md, "Slurm: decide at submission"); needs Debian's
-- lua-socket and lua-cjson (Lua 5.1, the version slurm-wlm's plugins embed).
--
-- Settings: slurmctld's (or the client's) environment as the TaskProlog takes them
-- (AUTOBATCH_CENTRAL_URL, AUTOBATCH_API_TOKEN), overridden by the file named by
-- AUTOBATCH_SUBMIT_CONFIG (default /etc/slurm/autobatch.conf): lines `key = value`, `#` comments:
--   central_url = http://10.0.0.5:8000   token_file = /etc/slurm/autobatch.token
--   timeout_s = 2        (each decision's hard bound, at most 2)
--   on_failure = open    (open: the job goes in unchanged; closed: refused)
--   retry_after_s = 30   (after a failure, decide nothing for this long: fail at once)
--   cache_s = 60         (answers kept this long)
--   sizing = allow       (allow | deny: jobs setting AUTOBATCH_SIZE_GPUS=1 may be sized)
--   advice = on          (on | off: cli_filter.lua shows the decision before submission)
--   allowed_gpus = 1,2,4,8,16   max_gpus = 16
--   card = NVIDIA H100 80GB HBM3               (the card when nothing else names it)
--   card.partition.<partition> = <card name>   card.gres.<gres type> = <card name>
-- A broken or missing file is logged and the environment's settings hold.
local M = {}

local socket_ok, socket = pcall(require, "socket")
local json_ok, cjson = pcall(require, "cjson")

M.MAX_TIMEOUT_S = 2.0
M.DEFAULT_CONFIG = "/etc/slurm/autobatch.conf"
M.SIZE_VARIABLE = "AUTOBATCH_SIZE_GPUS"

local cache = {}          -- request key -> {at = seconds, answer = table}
local cache_count = 0
local down_until = 0      -- no service call before this time (after a failure)
local down_reason = ""

local function now()
    if socket_ok then
        return socket.gettime()
    end
    return os.time()
end

local function trim(text)
    return (text:gsub("^%s+", ""):gsub("%s+$", ""))
end

-- The settings: defaults, the environment, then the file. Returns settings, warning or nil.
function M.settings(getenv)
    getenv = getenv or os.getenv
    local s = {
        central_url = getenv("AUTOBATCH_CENTRAL_URL") or "http://autobatch-central:8000",
        token = getenv("AUTOBATCH_API_TOKEN"),
        timeout_s = M.MAX_TIMEOUT_S,
        on_failure = "open",
        retry_after_s = 30,
        cache_s = 60,
        sizing = "allow",
        advice = "on",
        allowed_gpus = nil,
        max_gpus = nil,
        card = nil,
        partition_cards = {},
        gres_cards = {},
    }
    local path = getenv("AUTOBATCH_SUBMIT_CONFIG") or M.DEFAULT_CONFIG
    local file = io.open(path, "r")
    if file == nil then
        return s, nil
    end
    local warning = nil
    local number = 0
    for line in file:lines() do
        number = number + 1
        line = trim(line:gsub("#.*$", ""))
        if line ~= "" then
            local key, value = line:match("^([%w_.%-]+)%s*=%s*(.-)$")
            local bad = M.apply(s, key, value)
            if bad ~= nil then
                warning = string.format("%s line %d: %s (ignored)", path, number, bad)
            end
        end
    end
    file:close()
    if s.token_file ~= nil then
        local token = io.open(s.token_file, "r")
        if token == nil then
            warning = "token_file " .. s.token_file .. " cannot be read"
        else
            s.token = trim(token:read("*a") or "")
            token:close()
        end
    end
    return s, warning
end

local NUMBERS = {timeout_s = true, retry_after_s = true, cache_s = true, max_gpus = true}

-- One `key = value` of the file into the settings; an error in words, or nil.
function M.apply(s, key, value)
    if key == nil then
        return "not `key = value`"
    end
    local partition = key:match("^card%.partition%.(.+)$")
    local gres = key:match("^card%.gres%.(.+)$")
    if partition then
        s.partition_cards[partition] = value
    elseif gres then
        s.gres_cards[gres] = value
    elseif NUMBERS[key] then
        local n = tonumber(value)
        if n == nil or n < 0 then
            return key .. " = " .. value .. " is not a number of seconds or GPUs"
        end
        s[key] = key == "timeout_s" and math.min(n, M.MAX_TIMEOUT_S) or n
    elseif key == "allowed_gpus" then
        local counts = {}
        for count in value:gmatch("[^,%s]+") do
            if tonumber(count) == nil then
                return "allowed_gpus = " .. value .. " is not counts like 1,2,4,8"
            end
            counts[#counts + 1] = tonumber(count)
        end
        s.allowed_gpus = counts
    elseif key == "on_failure" and value ~= "open" and value ~= "closed" then
        return "on_failure = " .. value .. " is not open or closed"
    elseif key == "sizing" and value ~= "allow" and value ~= "deny" then
        return "sizing = " .. value .. " is not allow or deny"
    elseif key == "advice" and value ~= "on" and value ~= "off" then
        return "advice = " .. value .. " is not on or off"
    elseif key == "central_url" or key == "token_file" or key == "card"
            or key == "on_failure" or key == "sizing" or key == "advice" then
        s[key] = value
    else
        return "unknown key " .. key
    end
    return nil
end

-- GPUs in one TRES/GRES specification ("gres:gpu:4", "gres/gpu:h100:2", "gpu:a100:1",
-- "gpu:2,license:x"): count, type (or nil); 0 when it names no GPUs.
function M.gpus_in(spec)
    local count, kind = 0, nil
    if spec == nil or spec == "" then
        return 0, nil
    end
    for item in tostring(spec):gmatch("[^,]+") do
        item = item:gsub("^gres[:/]", ""):gsub("=", ":")  -- gres/gpu:h100=2 as gpu:h100:2
        local name, rest = item:match("^([^:]+):?(.*)$")
        if name == "gpu" then
            local t, n = rest:match("^([^:]+):(%d+)")
            if n == nil then
                n = rest:match("^(%d+)$") or (rest == "" and "1" or nil)
                t = n == nil and rest or nil
                n = n or "1"
            end
            count = count + tonumber(n)
            kind = kind or t
        end
    end
    return count, kind
end

-- The job's request for the service, or nil and why there is nothing to decide.
-- job: {environment = table, partition, nodes, per_node, per_job, per_task, tasks}
function M.request(job, s)
    local env = job.environment or {}
    local fingerprint = env.AUTOBATCH_MODEL_FINGERPRINT
    if fingerprint == nil or fingerprint == "" then
        return nil, nil  -- names no model: untouched, nothing said
    end
    local batch = tonumber(env.AUTOBATCH_EFFECTIVE_BATCH_SIZE or "")
    if batch == nil then
        return nil, "AUTOBATCH_EFFECTIVE_BATCH_SIZE is not set to a number; nothing decided"
    end
    local ranks = env.AUTOBATCH_JOB_WORLD_SIZE
    if ranks == "" then
        ranks = nil
    end
    if ranks ~= nil then
        local n = tonumber(ranks)
        if n == nil or n < 1 or n ~= math.floor(n) then
            return nil, "AUTOBATCH_JOB_WORLD_SIZE=" .. ranks .. " is not a whole number of ranks "
                .. "(set it to the data-parallel ranks the job trains with, or unset it to plan "
                .. "for the GPUs it asks); nothing decided"
        end
        ranks = n
    end
    local per_node, node_type = M.gpus_in(job.per_node)
    local per_job, job_type = M.gpus_in(job.per_job)
    local per_task, task_type = M.gpus_in(job.per_task)
    local nodes = job.nodes or 1
    local gpus = per_job
    if gpus == 0 and per_node > 0 then
        gpus = per_node * nodes
    elseif gpus == 0 and per_task > 0 then
        gpus = per_task * (job.tasks or 1)
    end
    local kind = job_type or node_type or task_type
    local size = env[M.SIZE_VARIABLE] == "1" and s.sizing == "allow"
    if gpus == 0 and not size then
        return nil, "the job asks for no GPUs (--gres=gpu:N, --gpus or --gpus-per-node); nothing decided"
    end
    local card = (kind and s.gres_cards[kind]) or (job.partition and s.partition_cards[job.partition])
        or s.card
    local body = {
        model_fingerprint = fingerprint,
        effective_batch_size = batch,
        policy = {size = size},
    }
    if gpus > 0 then
        body.world_size = ranks or gpus
    end
    if card then
        body.cards = {card}
    end
    if s.allowed_gpus then
        body.policy.allowed_world_sizes = s.allowed_gpus
    end
    if s.max_gpus then
        body.policy.max_world_size = s.max_gpus
    end
    local key = table.concat({fingerprint, batch, card or "", tostring(body.world_size),
        tostring(size), table.concat(s.allowed_gpus or {}, ","), tostring(s.max_gpus)}, "|")
    return {body = body, key = key, gpus = gpus, kind = kind, nodes = nodes}, nil
end

-- POST path with a JSON body, all of it within deadline (socket.gettime()): status, body or
-- nil, error. Each call (connect, send, receive) gets the time left as its total timeout.
function M.post(url, path, body, token, deadline)
    local host, port, base = url:match("^http://([^:/]+):?(%d*)(.*)$")
    if host == nil then
        return nil, "central_url " .. url .. " is not http://HOST[:PORT]"
    end
    base = base:gsub("/$", "")
    local sock = socket.tcp()
    local function bound()
        local left = deadline - now()
        if left <= 0 then
            return false
        end
        sock:settimeout(left, "t")
        return true
    end
    local ok, err = bound() and sock:connect(host, tonumber(port) or 80)
    if not ok then
        sock:close()
        return nil, "cannot connect to " .. url .. ": " .. tostring(err or "timeout")
    end
    local head = {
        "POST " .. base .. path .. " HTTP/1.0",
        "Host: " .. host,
        "Content-Type: application/json",
        "Content-Length: " .. #body,
        "Connection: close",
    }
    if token and token ~= "" then
        head[#head + 1] = "Authorization: Bearer " .. token
    end
    local request = table.concat(head, "\r\n") .. "\r\n\r\n" .. body
    ok, err = bound() and sock:send(request)
    if not ok then
        sock:close()
        return nil, "sending to " .. url .. ": " .. tostring(err or "timeout")
    end
    local data, rerr, partial
    if bound() then
        data, rerr, partial = sock:receive("*a")
    else
        rerr = "timeout"
    end
    sock:close()
    data = data or (rerr == "closed" and partial) or nil
    if data == nil then
        return nil, "no answer from " .. url .. " within the bound (" .. tostring(rerr) .. ")"
    end
    local status = tonumber(data:match("^HTTP/%d%.%d (%d%d%d)"))
    local content = data:match("\r\n\r\n(.*)$") or ""
    return status, content
end

-- The decision for a job: answer table or nil, and the failure in words.
function M.decide(request, s)
    if not socket_ok or not json_ok then
        return nil, "lua-socket and lua-cjson are needed (apt-get install lua-socket lua-cjson)"
    end
    local t = now()
    local hit = cache[request.key]
    if hit ~= nil and t - hit.at <= s.cache_s then
        return hit.answer, nil
    end
    if t < down_until then
        return nil, down_reason .. " (not asked again for " .. math.ceil(down_until - t) .. " s)"
    end
    local timeout = math.min(s.timeout_s, M.MAX_TIMEOUT_S)
    local status, content = M.post(s.central_url, "/v1/admissions", cjson.encode(request.body),
        s.token, t + timeout)
    local answer = nil
    if status == 200 then
        local ok, decoded = pcall(cjson.decode, content)
        if ok and type(decoded) == "table" then
            answer = decoded
        else
            status, content = nil, "the service's answer is not JSON"
        end
    elseif status ~= nil then
        local ok, problem = pcall(cjson.decode, content)
        local detail = ok and type(problem) == "table" and problem.detail or content:sub(1, 200)
        content = "the service answered " .. status .. ": " .. tostring(detail)
    end
    if answer == nil then
        down_until = now() + s.retry_after_s
        down_reason = content
        return nil, content
    end
    if cache_count > 1000 then
        cache, cache_count = {}, 0
    end
    if cache[request.key] == nil then
        cache_count = cache_count + 1
    end
    cache[request.key] = {at = t, answer = answer}
    return answer, nil
end

-- The variables a job gets for its plan: the service's, and where the plan was decided.
function M.plan_variables(answer)
    local variables, names = {}, {}
    for name, value in pairs(answer.environment or {}) do
        variables[name] = tostring(value)
        names[#names + 1] = name
    end
    table.sort(names)
    variables.AUTOBATCH_PLAN_AT = "submit"
    variables.AUTOBATCH_PLAN_VARIABLES = table.concat(names, ",")
    return variables
end

-- The GPU specification that gives a job n GPUs of the kind it asked for.
function M.gpu_spec(n, kind)
    if kind then
        return "gres:gpu:" .. kind .. ":" .. n
    end
    return "gres:gpu:" .. n
end

function M.json_null(value)
    return value == nil or (json_ok and value == cjson.null)
end

-- Forget cached answers and failures (tests and `scontrol reconfigure` start afresh).
function M.reset()
    cache, cache_count, down_until, down_reason = {}, 0, 0, ""
end

return M
