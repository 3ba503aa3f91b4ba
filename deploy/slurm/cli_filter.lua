-- Slurm cli_filter/lua (sbatch, srun, salloc): shows the user autobatch's decision for the job
-- before it is submitted (docs/deploy.md, "Slurm: decide at submission"). Advisory only: it
-- never stops a submission and a user can bypass it; job_submit.lua in slurmctld decides.
-- slurm.conf: CliFilterPlugins=lua, this file as cli_filter.lua beside slurm.conf (Debian:
-- /etc/slurm/cli_filter.lua), and autobatch_admission.lua beside it.
--
-- The job names its model as for job_submit.lua, in the environment or in --export:
--   sbatch --export=ALL,AUTOBATCH_MODEL_FINGERPRINT=9c1e5b0f7a3d2e48,AUTOBATCH_EFFECTIVE_BATCH_SIZE=1024 --gres=gpu:8 ...
-- and sees, on stderr:  autobatch (advisory): accepted: effective batch 1024 = micro-batch 32 x ...

local NAMES = {"AUTOBATCH_MODEL_FINGERPRINT", "AUTOBATCH_EFFECTIVE_BATCH_SIZE",
    "AUTOBATCH_SIZE_GPUS", "AUTOBATCH_JOB_WORLD_SIZE"}

local function here()
    local source = debug.getinfo(1, "S").source
    return source:match("^@(.*/)") or "./"
end
package.path = here() .. "?.lua;" .. package.path

local loaded, admission = pcall(require, "autobatch_admission")

local function say(text)
    io.stderr:write("autobatch (advisory): " .. text .. "\n")
end

-- The job's AUTOBATCH_* variables: the environment (unless --export leaves it out), then
-- --export's own NAME=value entries.
local function environment(export)
    local env = {}
    export = export or "ALL"
    local all = export == "" or export:match("^ALL") ~= nil or export:match(",ALL") ~= nil
    if all then
        for _, name in ipairs(NAMES) do
            env[name] = os.getenv(name)
        end
    end
    for name, value in export:gmatch("(AUTOBATCH_[%w_]+)=([^,]*)") do
        env[name] = value
    end
    return env
end

local function first_number(value)
    return value and tonumber(tostring(value):match("^(%d+)")) or nil
end

local function advise(options)
    local s = admission.settings()
    if s.advice == "off" then
        return
    end
    local job = {
        environment = environment(options.export),
        partition = options.partition,
        nodes = first_number(options.nodes) or 1,
        per_node = options["gpus-per-node"] and ("gpu:" .. options["gpus-per-node"]) or options.gres,
        per_job = options.gpus and ("gpu:" .. options.gpus) or nil,
        per_task = options["gpus-per-task"] and ("gpu:" .. options["gpus-per-task"]) or nil,
        tasks = first_number(options.ntasks) or 1,
    }
    local request, why = admission.request(job, s)
    if request == nil then
        if why then
            say(why)
        end
        return
    end
    local answer, err = admission.decide(request, s)
    if answer == nil then
        say("no decision (" .. err .. "); slurmctld decides at submission")
        return
    end
    say(tostring(answer.message))
end

function slurm_cli_setup_defaults(options, early_pass)
    return slurm.SUCCESS
end

function slurm_cli_pre_submit(options, pack_offset)
    if loaded then
        local ok, err = pcall(advise, options)
        if not ok then
            say("no decision: " .. tostring(err))
        end
    end
    return slurm.SUCCESS
end

function slurm_cli_post_submit(offset, job_id, step_id)
    return slurm.SUCCESS
end
