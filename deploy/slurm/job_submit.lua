-- Slurm job_submit/lua (slurmctld): autobatch decides a job's plan at submission
-- (docs/deploy.md, "Slurm: decide at submission"). slurm.conf: JobSubmitPlugins=lua, this file
-- as job_submit.lua beside slurm.conf (Debian: /etc/slurm/job_submit.lua), and
-- autobatch_admission.lua beside it.
--
-- For a batch job naming its model and effective batch in its environment
--   sbatch --export=ALL,AUTOBATCH_MODEL_FINGERPRINT=9c1e5b0f7a3d2e48,AUTOBATCH_EFFECTIVE_BATCH_SIZE=1024 --gres=gpu:8 ...
-- it asks the central service's POST /v1/admissions (within timeout_s, 2 s at most) and:
-- - accepted: the plan goes into the job's environment (AUTOBATCH_MICRO_BATCH_SIZE, ...,
--   AUTOBATCH_PLAN_AT=submit), so its scripts and the TaskProlog see the one plan decided here;
-- - sized (the job set AUTOBATCH_SIZE_GPUS=1 and the site allows it): its GPU count is set to
--   the plan's, and the plan goes into its environment;
-- - unreachable: sbatch fails at once, naming the nearest batches and the GPU counts that reach it;
-- - unplanned (no profile of the model), or a job naming no model: unchanged.
-- When the service is down, frozen or slow, the job goes in unchanged with a note to the user
-- and a log line (on_failure = open, the default), or is refused (on_failure = closed).
-- Any error in this file or its settings is logged and the job goes in unchanged: a broken
-- configuration never stops slurmctld.

local NO_VAL = 4294967294

local function here()
    local source = debug.getinfo(1, "S").source
    return source:match("^@(.*/)") or "./"
end
package.path = here() .. "?.lua;" .. package.path

local loaded, admission = pcall(require, "autobatch_admission")

local function note(text)
    slurm.log_user("autobatch: " .. text)
end

local function log(text)
    slurm.log_info("job_submit/lua autobatch: %s", text)
end

local function count(value)
    if value == nil or value == NO_VAL or value == 0 or value >= NO_VAL then
        return nil
    end
    return value
end

local function failed(why, s)
    log("no decision: " .. why)
    if s ~= nil and s.on_failure == "closed" then
        note("the job is refused: no plan could be decided at submission (" .. why .. ")")
        return slurm.ERROR
    end
    note("no plan at submission (" .. why .. "); the job goes in unchanged and its tasks ask "
        .. "for a plan when they start")
    return slurm.SUCCESS
end

local function attach(job_desc, answer, request)
    for name, value in pairs(admission.plan_variables(answer)) do
        job_desc.environment[name] = value
    end
    local plan = answer.plan
    job_desc.admin_comment = string.format("autobatch: %s %s x %s x %s GPUs (profile %s)",
        answer.outcome, plan.micro_batch_size, plan.gradient_accumulation_steps,
        plan.world_size, tostring(answer.profile_id))
    if answer.outcome == "sized" then
        local spec = admission.gpu_spec(answer.world_size, request.kind)
        if request.nodes > 1 or job_desc.tres_per_job ~= nil then
            job_desc.tres_per_job = spec
            job_desc.tres_per_node = nil
        else
            job_desc.tres_per_node = spec
        end
    end
end

local function submit(job_desc)
    local s, warning = admission.settings()
    if warning then
        log(warning)
    end
    if job_desc.script == nil or job_desc.environment == nil then
        return slurm.SUCCESS  -- srun/salloc: no environment here; the TaskProlog plans
    end
    local job = {
        environment = job_desc.environment,
        partition = job_desc.partition,
        nodes = count(job_desc.min_nodes) or 1,
        per_node = job_desc.tres_per_node,
        per_job = job_desc.tres_per_job,
        per_task = job_desc.tres_per_task,
        tasks = count(job_desc.num_tasks) or 1,
    }
    local request, why = admission.request(job, s)
    if request == nil then
        if why then
            note(why)
            log("nothing decided: " .. why)
        end
        return slurm.SUCCESS
    end
    local answer, err = admission.decide(request, s)
    if answer == nil then
        return failed(err, s)
    end
    local message = tostring(answer.message)
    if answer.outcome == "unreachable" then
        log("refused: " .. message)
        note("the job cannot reach its effective batch: " .. message)
        return slurm.ERROR
    end
    if answer.outcome == "accepted" or answer.outcome == "sized" then
        attach(job_desc, answer, request)
    end
    note(message)
    log(answer.outcome .. ": " .. message)
    return slurm.SUCCESS
end

function slurm_job_submit(job_desc, part_list, submit_uid)
    if not loaded then
        slurm.log_error("job_submit/lua autobatch: cannot load autobatch_admission.lua: %s",
            tostring(admission))
        return slurm.SUCCESS
    end
    local ok, result = pcall(submit, job_desc)
    if not ok then
        slurm.log_error("job_submit/lua autobatch: %s (the job goes in unchanged)", tostring(result))
        return slurm.SUCCESS
    end
    return result
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
    return slurm.SUCCESS
end

return slurm.SUCCESS
